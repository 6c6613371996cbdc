"""Pause and resume with memory: E2B sandboxes on gVisor (the template
conftest.GVISOR_TEMPLATE, `--e2b-driver busybox-gvisor=gvisor`), through the
real e2b==2.63.0 SDK. Without runsc these tests skip, loudly; under CI=true
they fail."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
from e2b import CommandExitException, PtySize, Sandbox, SandboxException

# The image conftest.py builds and serves on gVisor (`--e2b-driver
# busybox-gvisor=gvisor`). Not imported from conftest: with several test
# directories in one pytest run, `conftest` names another directory's.
GVISOR_TEMPLATE = "busybox-gvisor"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

# An HTTP server in busybox sh: each request gets the shell's pid, a nonce
# drawn once at its start and the count of requests served, all held only
# in the shell's memory (one `nc -l` per request, the loop between them).
# The count moves only when nc served: a restore interrupts the accept it
# was blocked in, and busybox nc gives up on that.
COUNTER_SERVER = (
    "nonce=$RANDOM$RANDOM; i=0; while true; do n=$((i+1)); "
    "printf 'HTTP/1.0 200 OK\\r\\nContent-Type: text/plain\\r\\n\\r\\n%s %s %s\\n' $$ $nonce $n "
    "| nc -l -p 8080 >/dev/null 2>&1 && i=$n; done"
)


@pytest.fixture
def gsbx(needs_runsc):
    s = Sandbox.create(template=GVISOR_TEMPLATE)
    yield s
    Sandbox.kill(s.sandbox_id)


def start_counter(sbx):
    """Starts the counter server as a background command (no command timeout)."""
    return sbx.commands.run(COUNTER_SERVER, background=True, timeout=0)


def ask(sbx, when):
    """One request to the counter server from inside the sandbox: (pid, nonce, count)."""
    r = sbx.commands.run(
        "for t in $(seq 50); do wget -q -O - http://127.0.0.1:8080/ && exit 0; sleep 0.1; done; exit 1"
    )
    fields = [int(f) for f in r.stdout.split() if f.isdigit()]
    assert len(fields) == 3, f"unexpected answer {when}: {r.stdout!r}"
    return tuple(fields)


def test_file_metadata_under_gvisor_is_kept_or_refused_with_nothing_written(gsbx):
    # Bookworm's runsc keeps no user attributes on its root file system: the
    # upload is then a 400 saying so, and neither the file's new content
    # nor its temporary name is left. A runsc that keeps them keeps the
    # metadata.
    from e2b import InvalidArgumentException

    gsbx.files.write("/home/user/kept.txt", "before")
    try:
        gsbx.files.write("/home/user/kept.txt", "after", metadata={"a": "b"})
    except InvalidArgumentException as err:
        assert "nothing was written" in str(err), err
        assert gsbx.files.read("/home/user/kept.txt") == "before"
        assert [e.name for e in gsbx.files.list("/home/user")] == ["kept.txt"]
        # Without metadata the same write goes through.
        gsbx.files.write("/home/user/kept.txt", "after")
    else:
        assert gsbx.files.get_info("/home/user/kept.txt").metadata == {"a": "b"}
    assert gsbx.files.read("/home/user/kept.txt") == "after"


def test_a_background_server_keeps_its_memory_across_ten_pause_and_connect_cycles(gsbx):
    server = start_counter(gsbx)
    pid, nonce, first = ask(gsbx, "before any pause")
    assert first == 1
    for cycle in range(1, 11):
        assert gsbx.pause()
        assert Sandbox.get_info(gsbx.sandbox_id).state.value == "paused"
        back = Sandbox.connect(gsbx.sandbox_id)
        assert back.sandbox_id == gsbx.sandbox_id
        when = f"after resume {cycle}"
        assert ask(back, when) == (pid, nonce, cycle + 1), f"{when}: another process answered, or the count restarted"
        # The gateway still knows the background command.
        assert any(p.pid == server.pid for p in back.commands.list()), when


def cairn_sandboxes(cairn_e2b):
    """The Cairn sandboxes under the server's state directory: {id: state}."""
    out = subprocess.run(
        [cairn_e2b["bin"], "ps", "--json"],
        env=dict(os.environ, CAIRN_HOME=cairn_e2b["home"]),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {s["id"]: s["state"] for s in json.loads(out)}


def wait_for_prepared(cairn_e2b, before):
    """Waits for the sandbox the server prepares after a pause (state
    creating, not in `before`); returns its id."""
    deadline = time.time() + 30
    while True:
        new = {i for i, st in cairn_sandboxes(cairn_e2b).items() if st == "creating" and i not in before}
        if new:
            assert len(new) == 1, new
            return new.pop()
        assert time.time() < deadline, "no sandbox was prepared for the paused sandbox's resume"
        time.sleep(0.1)


def test_a_resume_goes_into_the_sandbox_prepared_at_the_pause(needs_runsc, cairn_e2b):
    s = Sandbox.create(template=GVISOR_TEMPLATE)
    try:
        start_counter(s)
        pid, nonce, _ = ask(s, "before the pause")
        for cycle in (1, 2):
            before = set(cairn_sandboxes(cairn_e2b))
            assert s.pause()
            prepared = wait_for_prepared(cairn_e2b, before)
            # Prepared, it runs nothing: the sandbox stays paused.
            time.sleep(0.5)
            assert Sandbox.get_info(s.sandbox_id).state.value == "paused"
            assert cairn_sandboxes(cairn_e2b)[prepared] == "creating"
            back = Sandbox.connect(s.sandbox_id)
            assert ask(back, f"after resume {cycle}") == (pid, nonce, cycle + 1)
            now = cairn_sandboxes(cairn_e2b)
            assert now.get(prepared) == "running", f"the resume did not use the prepared sandbox: {now}"
            assert "creating" not in now.values(), now
        # Removed from under the gateway (`cairn rm`): the resume goes the
        # ordinary way.
        before = set(cairn_sandboxes(cairn_e2b))
        assert s.pause()
        prepared = wait_for_prepared(cairn_e2b, before)
        subprocess.run(
            [cairn_e2b["bin"], "rm", "--force", prepared],
            env=dict(os.environ, CAIRN_HOME=cairn_e2b["home"]),
            check=True,
            capture_output=True,
        )
        back = Sandbox.connect(s.sandbox_id)
        assert ask(back, "after its prepared sandbox was removed") == (pid, nonce, 4)
        assert prepared not in cairn_sandboxes(cairn_e2b)
        # Killed while paused: the prepared sandbox goes too.
        before = set(cairn_sandboxes(cairn_e2b))
        assert s.pause()
        prepared = wait_for_prepared(cairn_e2b, before)
        Sandbox.kill(s.sandbox_id)
        deadline = time.time() + 30
        while prepared in cairn_sandboxes(cairn_e2b):
            assert time.time() < deadline, "the prepared sandbox of a killed one stayed"
            time.sleep(0.1)
    finally:
        Sandbox.kill(s.sandbox_id)


def test_a_paused_background_command_is_followed_again_after_connect(gsbx):
    h = gsbx.commands.run("i=0; while true; do i=$((i+1)); echo tick$i; sleep 0.1; done", background=True, timeout=0)
    time.sleep(0.5)
    assert gsbx.pause()
    # The stream the handle held ends with the pause; the process does not.
    with pytest.raises(SandboxException) as exc:
        h.wait()
    assert "was paused" in str(exc.value)
    back = Sandbox.connect(gsbx.sandbox_id)
    again = back.commands.connect(h.pid)
    seen = []
    for out, _, _ in again:
        if out:
            seen.append(out)
        if len("".join(seen).split()) >= 3:
            break
    ticks = [int(t[4:]) for t in "".join(seen).split() if t.startswith("tick") and t[4:].isdigit()]
    assert ticks and ticks[0] > 3, f"the loop started again instead of going on: {seen!r}"
    assert back.commands.kill(h.pid)
    with pytest.raises(CommandExitException) as killed:
        again.wait()
    assert killed.value.exit_code == -1
    assert not any(p.pid == h.pid for p in back.commands.list())


def test_a_command_with_stdin_holds_off_a_memory_pause_and_loses_nothing(gsbx):
    gsbx.files.write("/tmp/in-memory.txt", "kept")
    h = gsbx.commands.run("head -n 1", background=True, stdin=True)
    with pytest.raises(SandboxException) as exc:
        gsbx.pause()
    assert "stdin" in str(exc.value) and str(h.pid) in str(exc.value)
    assert Sandbox.get_info(gsbx.sandbox_id).state.value == "running"
    gsbx.commands.send_stdin(h.pid, "typed\n")
    assert h.wait().stdout == "typed\n"
    assert gsbx.pause()
    back = Sandbox.connect(gsbx.sandbox_id)
    # gVisor's /tmp is memory: only a memory snapshot keeps it.
    assert back.files.read("/tmp/in-memory.txt") == "kept"


def test_a_pty_works_under_gvisor_and_holds_off_a_memory_pause(gsbx):
    h = gsbx.pty.create(size=PtySize(rows=33, cols=99))
    out = bytearray()
    gsbx.pty.send_stdin(h.pid, b"stty size\n")
    with pytest.raises(SandboxException) as exc:
        gsbx.pause()
    assert "terminal" in str(exc.value) and str(h.pid) in str(exc.value)
    gsbx.pty.send_stdin(h.pid, b"exit 4\n")
    with pytest.raises(CommandExitException) as ended:
        h.wait(on_pty=out.extend)
    assert ended.value.exit_code == 4
    assert b"33 99" in out, out
    assert gsbx.pause()


def test_a_server_port_is_reached_under_gvisor_and_after_a_pause(gsbx):
    import httpx

    gsbx.files.write("/tmp/www/index.html", "from gvisor")
    gsbx.commands.run("httpd -f -p 127.0.0.1:8000 -h /tmp/www", background=True)
    url = os.environ["E2B_SANDBOX_URL"]

    def fetch(sbx):
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000", "X-Access-Token": sbx._envd_access_token}
        deadline = time.time() + 15
        while True:
            r = httpx.get(f"{url}/index.html", headers=headers)
            if r.status_code == 200 or time.time() > deadline:
                return r
            time.sleep(0.1)

    r = fetch(gsbx)
    assert r.status_code == 200 and r.text == "from gvisor", r.text
    # The server is one of the processes a memory pause keeps.
    assert gsbx.pause()
    back = Sandbox.connect(gsbx.sandbox_id)
    r = fetch(back)
    assert r.status_code == 200 and r.text == "from gvisor", r.text


def test_auto_pause_at_the_timeout_keeps_a_running_process(needs_runsc):
    s = Sandbox.create(template=GVISOR_TEMPLATE, timeout=30, lifecycle={"on_timeout": "pause"})
    try:
        start_counter(s)
        pid, nonce, _ = ask(s, "before the timeout")
        s.set_timeout(1)
        deadline = time.time() + 30
        while Sandbox.get_info(s.sandbox_id).state.value != "paused":
            assert time.time() < deadline, "the sandbox did not pause at its timeout"
            time.sleep(0.25)
        back = Sandbox.connect(s.sandbox_id, timeout=60)
        assert ask(back, "after the auto-pause") == (pid, nonce, 2)
    finally:
        Sandbox.kill(s.sandbox_id)


def test_a_paused_gvisor_sandbox_survives_a_server_restart_with_its_memory(needs_runsc, cairn_e2b):
    s = Sandbox.create(template=GVISOR_TEMPLATE)
    try:
        start_counter(s)
        pid, nonce, _ = ask(s, "before the restart")
        assert s.pause()
        cairn_e2b["restart"]()
        assert Sandbox.get_info(s.sandbox_id).state.value == "paused"
        back = Sandbox.connect(s.sandbox_id)
        assert ask(back, "after the restart") == (pid, nonce, 2)
        # A new server does not know the commands an earlier one started.
        assert back.commands.list() == []
    finally:
        Sandbox.kill(s.sandbox_id)


def test_a_server_killed_with_a_prepared_resume_leaves_nothing_of_it_and_resumes(needs_runsc, cairn_e2b):
    s = Sandbox.create(template=GVISOR_TEMPLATE)
    try:
        start_counter(s)
        pid, nonce, _ = ask(s, "before the kill")
        before = set(cairn_sandboxes(cairn_e2b))
        assert s.pause()
        prepared = wait_for_prepared(cairn_e2b, before)
        os.kill(cairn_e2b["pid"](), signal.SIGKILL)
        cairn_e2b["restart"]()
        # The next Cairn command removed the dead server's prepared sandbox,
        # runsc's processes and all.
        assert prepared not in cairn_sandboxes(cairn_e2b)
        left = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    cmdline = open(f"/proc/{p}/cmdline", "rb").read()
                except OSError:
                    continue
                if prepared.encode() in cmdline:
                    left.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
        assert left == [], f"processes of the prepared sandbox are left: {left}"
        back = Sandbox.connect(s.sandbox_id)
        assert ask(back, "after the kill") == (pid, nonce, 2)
    finally:
        Sandbox.kill(s.sandbox_id)


def test_a_native_pause_keeps_files_and_ends_processes():
    s = Sandbox.create()
    try:
        h = s.commands.run("sleep 600", background=True, timeout=0)
        s.files.write("/home/user/kept.txt", "kept")
        assert s.pause()
        back = Sandbox.connect(s.sandbox_id)
        assert back.files.read("/home/user/kept.txt") == "kept"
        assert back.commands.list() == []
        assert "sleep 600" not in back.commands.run("ps").stdout
        assert h.pid > 0
    finally:
        Sandbox.kill(s.sandbox_id)


def test_a_gvisor_template_without_runsc_fails_naming_what_to_install(cairn_e2b):
    home = tempfile.mkdtemp(prefix="cairn-e2b-norunsc-")
    env = dict(os.environ, CAIRN_HOME=home, CAIRN_RUNSC=os.path.join(home, "no-runsc"))
    server = None
    try:
        out = subprocess.run(
            [cairn_e2b["bin"], "token", "create", "t"], env=env, check=True, capture_output=True, text=True
        ).stdout
        key = next(w for w in out.split() if len(w) >= 20)
        port = _free_port()
        server = subprocess.Popen(
            [cairn_e2b["bin"], "serve", "--e2b", f"127.0.0.1:{port}", "--e2b-base", "busybox",
             "--e2b-driver", "gvisor"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, "the server did not start"
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(SandboxException) as exc:
            Sandbox.create(api_key=key, api_url=url, sandbox_url=url)
        assert "apt-get install runsc" in str(exc.value)
    finally:
        if server:
            server.terminate()
            server.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)


def test_a_watch_works_under_gvisor_and_ends_with_a_pause(gsbx):
    from e2b.sandbox.filesystem.watch_handle import FilesystemEventType as T

    gsbx.files.make_dir("/tmp/gw")
    h = gsbx.files.watch_dir("/tmp/gw", recursive=True)
    gsbx.commands.run("mkdir /tmp/gw/d && echo x > /tmp/gw/d/f && echo y > /tmp/gw/top")
    seen, deadline = [], time.time() + 15
    while time.time() < deadline and ("top", T.CREATE) not in seen:
        seen += [(e.name, e.type) for e in h.get_new_events()]
        time.sleep(0.1)
    assert ("d", T.CREATE) in seen and ("d/f", T.CREATE) in seen and ("top", T.CREATE) in seen, seen
    # A pause ends the sandbox's watches; after connect a new one works.
    assert gsbx.pause()
    s = Sandbox.connect(gsbx.sandbox_id)
    with pytest.raises(SandboxException):
        h.get_new_events()
    h = s.files.watch_dir("/tmp/gw")
    s.commands.run("touch /tmp/gw/again")
    deadline = time.time() + 15
    seen = []
    while time.time() < deadline and ("again", T.CREATE) not in seen:
        seen += [(e.name, e.type) for e in h.get_new_events()]
        time.sleep(0.1)
    assert ("again", T.CREATE) in seen, seen
    h.stop()


def test_metrics_of_a_gvisor_sandbox_count_its_sentry(gsbx):
    # The sentry and its processes live in the sandbox's cgroup: a busy
    # loop inside shows as CPU, and a file written shows as disk.
    gsbx.files.write("/home/user/big.bin", os.urandom(8 << 20))
    busy = gsbx.commands.run("while :; do :; done", background=True, timeout=0)
    try:
        m = gsbx.get_metrics()[-1]
        assert m.cpu_used_pct > 10, m
        assert 0 < m.mem_used <= m.mem_total, m
        assert m.disk_total > 0, m
    finally:
        busy.kill()
