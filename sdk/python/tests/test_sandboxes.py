import time

import pytest

import cairn


def test_create_exec_and_remove_over_either_transport(any_client):
    sb = any_client.sandboxes.create(image="busybox")
    assert sb.state == "running" and sb.image == "busybox"
    assert sb.id in [s.id for s in any_client.sandboxes.list(state="running")]
    result = sb.exec(["echo", "hello"])
    assert (result.exit_code, result.stdout) == (0, "hello\n")
    sb.remove(force=True)
    with pytest.raises(cairn.NotFound):
        any_client.sandboxes.get(sb.id)


def test_exec_reports_exit_codes(sandbox):
    assert sandbox.exec("exit 3").exit_code == 3
    missing = sandbox.exec(["no-such-program"])
    assert missing.exit_code == 127 and not missing.ok
    err = sandbox.exec("echo oops >&2; false")
    assert (err.exit_code, err.stderr) == (1, "oops\n")


def test_exec_passes_stdin_env_and_cwd(sandbox):
    assert sandbox.exec("tr a-z A-Z", stdin="shout\n").stdout == "SHOUT\n"
    assert sandbox.exec('echo "$GREETING"', env={"GREETING": "hi there"}).stdout == "hi there\n"
    assert sandbox.exec("pwd", cwd="/tmp").stdout == "/tmp\n"


def test_exec_timeout_kills_the_command(sandbox):
    started = time.monotonic()
    result = sandbox.exec(["sleep", "30"], timeout=0.5)
    assert result.timed_out and result.exit_code == 124
    assert time.monotonic() - started < 10


def test_streamed_exec_yields_output_as_it_happens(sandbox):
    stream = sandbox.exec_stream("for i in 1 2 3; do echo line $i; sleep 0.4; done; echo done >&2; exit 5")
    arrivals = []
    for out in stream:
        arrivals.append((time.monotonic(), out.stream, out.data))
    ended = time.monotonic()
    assert [(s, d) for _, s, d in arrivals] == [
        ("stdout", b"line 1\n"), ("stdout", b"line 2\n"), ("stdout", b"line 3\n"), ("stderr", b"done\n")]
    # The first line came about a second before the command ended, not with the exit.
    assert ended - arrivals[0][0] > 0.6
    assert arrivals[1][0] - arrivals[0][0] > 0.2
    assert stream.result.exit_code == 5 and stream.pid == stream.result.pid


def test_streamed_exec_process_can_be_signalled(sandbox):
    stream = sandbox.exec_stream(["sleep", "30"])
    pid = stream.started()
    sandbox.signal(pid, "TERM")
    result = stream.wait()
    assert result.signal == 15 and result.exit_code == 143


def test_context_manager_removes_the_sandbox(client):
    with client.sandboxes.create() as sb:
        assert sb.exec("true").ok
    with pytest.raises(cairn.NotFound):
        client.sandboxes.get(sb.id)


def test_idempotency_key_creates_one_sandbox(client):
    a = client.sandboxes.create(idempotency_key="sdk-create-once")
    b = client.sandboxes.create(idempotency_key="sdk-create-once")
    try:
        assert a.id == b.id
    finally:
        a.remove()


def test_events_report_sandbox_creation(client, server):
    import threading

    seen = []

    def listen():
        with cairn.Client(socket=server.socket) as c:
            for ev in c.events():
                seen.append(ev)
                if ev.kind == "sandbox.created":
                    return

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    time.sleep(0.3)
    with client.sandboxes.create() as sb:
        t.join(10)
    assert any(e.kind == "sandbox.created" and e.id == sb.id for e in seen)


def test_health_and_metrics(client):
    assert client.health().status == "ok"
    assert isinstance(client.metrics(), str)
    assert isinstance(client.dlq.list(), list)


def test_leaving_a_stream_early_ends_the_process(sandbox):
    stream = sandbox.exec_stream("echo go; exec sleep 30")
    for out in stream:
        assert out.data == b"go\n"
        deadline = time.monotonic() + 5
        while "sleep 30" not in sandbox.exec("ps -o args").stdout:
            assert time.monotonic() < deadline, "the streamed process never started sleeping"
            time.sleep(0.05)
        break
    deadline = time.monotonic() + 5
    while "sleep 30" in sandbox.exec("ps -o args").stdout:
        assert time.monotonic() < deadline, "the streamed process outlived its stream"
        time.sleep(0.1)
