"""E2B's code interpreter (`e2b-code-interpreter`, the version
requirements.txt pins) against `cairn serve --e2b`: a `code-interpreter`
image (`cairn image build code-interpreter`, Debian's Jupyter kernel,
numpy, pandas, matplotlib and images/code-interpreter/server.py), its
sandboxes serving port 49999 through the gateway. The image takes a few
minutes to build, once per run."""

import os
import subprocess
import time

import httpx
import pytest
from e2b import NotFoundException, SandboxException
from e2b_code_interpreter import Sandbox

TEMPLATE = "code-interpreter"
# The same image tagged with the name conftest.py serves on gVisor (not
# imported from conftest: with several test directories in one run,
# `conftest` names another directory's).
GVISOR_TEMPLATE = "code-interpreter-gvisor"


@pytest.fixture(scope="module")
def interpreter_image(cairn_e2b):
    env = dict(os.environ, CAIRN_HOME=cairn_e2b["home"])
    built = subprocess.run(
        [cairn_e2b["bin"], "image", "build", "code-interpreter", "--name", TEMPLATE],
        env=env,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return TEMPLATE


@pytest.fixture
def sbx(interpreter_image):
    s = Sandbox.create(template=interpreter_image)
    yield s
    Sandbox.kill(s.sandbox_id)


def test_state_lives_in_the_kernel_and_output_comes_back_rich(sbx):
    sbx.run_code("x = 40")
    assert sbx.run_code("x + 2").text == "42"
    # An exception: its name, value and traceback.
    failed = sbx.run_code("1 / 0")
    assert failed.error.name == "ZeroDivisionError", failed.error
    assert "division by zero" in failed.error.value
    assert "ZeroDivisionError" in failed.error.traceback
    # print streams as it happens: the first line before the cell ends.
    seen, at = [], {}
    started = time.time()

    def on_stdout(out):
        seen.append(out.line)
        at.setdefault("first", time.time() - started)

    run = sbx.run_code("import time\nprint('one')\ntime.sleep(1.5)\nprint('two')", on_stdout=on_stdout)
    assert [s.strip() for s in seen] == ["one", "two"], seen
    assert at["first"] < time.time() - started - 1, "stdout came only at the end"
    assert run.logs.stdout == ["one\n", "two\n"]
    # A chart is a PNG; a data frame has html and text.
    chart = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()")
    assert any(r.png for r in chart.results), chart
    png = next(r.png for r in chart.results if r.png)
    import base64

    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert frame.results[0].html and "<table" in frame.results[0].html
    # Variables of one cell's env_vars do not outlive it.
    assert sbx.run_code("import os; os.environ.get('GREETING')", envs={"GREETING": "hi"}).text == "'hi'"
    assert sbx.run_code("import os; os.environ.get('GREETING')").text is None


def test_contexts_are_independent_and_can_be_restarted_and_removed(sbx):
    a = sbx.create_code_context()
    b = sbx.create_code_context(cwd="/tmp")
    sbx.run_code("v = 'in a'", context=a)
    assert sbx.run_code("v", context=a).text == "'in a'"
    assert sbx.run_code("v", context=b).error.name == "NameError"
    assert sbx.run_code("import os; os.getcwd()", context=b).text == "'/tmp'"
    ids = {c.id for c in sbx.list_code_contexts()}
    assert {a.id, b.id} <= ids
    sbx.restart_code_context(a)
    assert sbx.run_code("v", context=a).error.name == "NameError"
    sbx.remove_code_context(b)
    assert b.id not in {c.id for c in sbx.list_code_contexts()}
    with pytest.raises((NotFoundException, SandboxException)):
        sbx.run_code("1", context=b)
    # A shell context.
    sh = sbx.run_code("echo from-shell; echo err >&2", language="bash")
    assert sh.logs.stdout == ["from-shell\n"] and sh.logs.stderr == ["err\n"], sh.logs


def test_a_dead_kernel_is_an_error_and_a_flood_is_bounded(sbx):
    died = sbx.run_code("import os; os._exit(1)")
    assert died.error is not None, died
    assert sbx.run_code("2 + 2").text == "4"
    # 200 MB printed: cut short, said so, and the kernel serves on.
    chunks = []
    flood = sbx.run_code("print('x' * (1 << 20) * 200)", on_stdout=lambda o: chunks.append(len(o.line)))
    assert sum(chunks) < 64 << 20, sum(chunks)
    assert any("truncated" in line for line in flood.logs.stderr), flood.logs.stderr
    assert sbx.run_code("3 + 3").text == "6"


def test_a_client_that_leaves_interrupts_its_cell(sbx):
    # The SDK's own timeout closes the connection mid-cell.
    with pytest.raises(Exception):
        sbx.run_code("import time\ntime.sleep(30)\nopen('/tmp/late', 'w').write('x')", timeout=1)
    start = time.time()
    assert sbx.run_code("1 + 1").text == "2"
    assert time.time() - start < 20
    time.sleep(1)
    assert not sbx.files.exists("/tmp/late")


def test_ports_need_a_token_and_the_traffic_token_is_the_sandboxes_own(sbx, interpreter_image):
    url = os.environ["E2B_SANDBOX_URL"]
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    assert httpx.get(f"{url}/contexts", headers=headers).status_code == 401
    other = Sandbox.create(template=interpreter_image)
    try:
        wrong = {**headers, "E2B-Traffic-Access-Token": other.traffic_access_token}
        assert httpx.get(f"{url}/contexts", headers=wrong).status_code in (401, 502)
        right = {**headers, "E2B-Traffic-Access-Token": sbx.traffic_access_token}
        assert httpx.get(f"{url}/contexts", headers=right).status_code == 200
    finally:
        Sandbox.kill(other.sandbox_id)


# A WebSocket echo server on the sandbox's loopback, the standard library's
# only: the handshake by RFC 6455, then each text frame sent back.
WS_SERVER = r"""
import base64, hashlib, socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8765))
s.listen()
def exact(c, n):
    data = b""
    while len(data) < n:
        got = c.recv(n - len(data))
        if not got:
            raise EOFError
        data += got
    return data
while True:
    c, _ = s.accept()
    head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    try:
        while True:
            b0, b1 = exact(c, 2)
            mask = exact(c, 4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(exact(c, b1 & 0x7F)))
            if b0 & 0x0F == 8:
                break
            c.sendall(bytes([0x81, len(data)]) + data)
    except EOFError:
        pass
    c.close()
"""


def _ws_frame(text):
    data = text.encode()
    mask = os.urandom(4)
    return bytes([0x81, 0x80 | len(data)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def test_a_websocket_to_a_sandbox_port_is_joined_through_the_gateway(sbx):
    import socket
    from urllib.parse import urlparse

    sbx.files.write("/tmp/ws.py", WS_SERVER)
    sbx.commands.run("python3 /tmp/ws.py", background=True)
    gateway = urlparse(os.environ["E2B_SANDBOX_URL"])
    for attempt in range(100):
        c = socket.create_connection((gateway.hostname, gateway.port), timeout=10)
        # The name get_host(8765) gives, under the *.localhost domain this
        # gateway accepts, and the traffic token.
        host = sbx.get_host(8765).split(".")[0] + ".localhost"
        c.sendall(
            (f"GET /chat HTTP/1.1\r\nHost: {host}\r\n"
             "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
             f"E2B-Traffic-Access-Token: {sbx.traffic_access_token}\r\n\r\n").encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            got = c.recv(4096)
            if not got:
                break
            head += got
        if head.startswith(b"HTTP/1.1 101"):
            break
        c.close()
        assert b"502" in head.split(b"\r\n")[0], head  # not listening yet
        time.sleep(0.1)
    else:
        raise AssertionError("the WebSocket server never answered")
    assert b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in head, head
    for text in ["hello", "through the gateway", "third"]:
        c.sendall(_ws_frame(text))
        frame = b""
        while len(frame) < 2 + len(text):
            frame += c.recv(4096)
        assert frame == bytes([0x81, len(text)]) + text.encode()
    c.close()


def test_warm_run_code_round_trip_is_reported(sbx):
    sbx.run_code("1 + 1")
    times = []
    for _ in range(30):
        t = time.perf_counter()
        assert sbx.run_code("1 + 1").text == "2"
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"\nrun_code('1+1') through the gateway: median {times[15] * 1e3:.1f} ms")


def test_on_native_a_pause_restarts_the_kernel_and_it_serves_again(sbx):
    sbx.run_code("kept = 'in memory'")
    assert sbx.pause()
    back = Sandbox.connect(sbx.sandbox_id)
    # Files survive a native pause; the kernel is a new one (docs/e2b.md).
    assert back.run_code("kept").error.name == "NameError"
    assert back.run_code("6 * 7").text == "42"


def test_on_gvisor_pause_and_connect_keep_the_kernel_and_its_variables(cairn_e2b, interpreter_image, needs_runsc):
    env = dict(os.environ, CAIRN_HOME=cairn_e2b["home"])
    tagged = subprocess.run(
        [cairn_e2b["bin"], "image", "tag", interpreter_image, GVISOR_TEMPLATE], env=env, capture_output=True, text=True
    )
    assert tagged.returncode == 0, tagged.stderr
    s = Sandbox.create(template=GVISOR_TEMPLATE)
    try:
        s.run_code("import os\nimport numpy as np\nstate = np.arange(10)\npid = os.getpid()")
        other = s.create_code_context()
        s.run_code("word = 'second context'", context=other)
        for cycle in range(3):
            assert s.pause()
            assert Sandbox.get_info(s.sandbox_id).state.value == "paused"
            s = Sandbox.connect(s.sandbox_id)
            # The same kernel process, with what it held.
            got = s.run_code("int(state.sum()), pid == os.getpid()")
            assert got.text == f"({45 + 10 * cycle}, True)", (cycle, got)
            s.run_code("state = state + 1")
            assert s.run_code("word", context=other).text == "'second context'"
        # A chart still comes back after the restores.
        chart = s.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2], [2, 1])\nplt.show()")
        assert any(r.png for r in chart.results), chart
    finally:
        Sandbox.kill(s.sandbox_id)
