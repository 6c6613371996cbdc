"""Starts `cairn serve --e2b` on a fresh state directory and points the real
e2b SDK at it (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY). Templates run on
the native driver, except GVISOR_TEMPLATE (a busybox image) on gVisor.

The binary is $CAIRN_BIN, else target/<host tuple>/debug/cairn (this builds nothing).
Needs root: the sandboxes are real."""

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import pytest

# The CLI acts as CAIRN_TOKEN's holder: these tests' commands are the
# administrator's unless a test gives a token.
os.environ.pop("CAIRN_TOKEN", None)

REPO = Path(__file__).resolve().parents[2]
# A Cairn image the server runs on gVisor (`--e2b-driver TEMPLATE=gvisor`).
GVISOR_TEMPLATE = "busybox-gvisor"
# test_code_interpreter.py's image, tagged with this name, also on gVisor.
GVISOR_INTERPRETER = "code-interpreter-gvisor"


def _host_tuple():
    """Cargo's output directory under target/ (.cargo/config.toml names the host as the target)."""
    return subprocess.run(["rustc", "--print", "host-tuple"], check=True, capture_output=True, text=True).stdout.strip()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The logs of the `cairn serve` processes running now, by home: a failed
# test's report ends with what they wrote meanwhile (a warning there, such
# as the request log's writer dropping rows, is often the why).
_SERVER_LOGS = {}


def _log_offset(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _server_logs_at_start(request):
    """Where each server's log stood when the test began."""
    request.node._server_log_offsets = {path: _log_offset(path) for path in _SERVER_LOGS.values()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when != "call" or not report.failed:
        return
    for path, start in getattr(item, "_server_log_offsets", {}).items():
        try:
            with open(path, errors="replace") as f:
                f.seek(start)
                during = f.read()
        except OSError:
            continue
        lines = during.splitlines()[-200:]
        report.sections.append((f"cairn serve log during the test ({path})", "\n".join(lines) or "(nothing)"))


def _wait_until_listening(server, port, home):
    """Waits up to 30 s for `cairn serve` to listen on `port`; its log
    (`home`/serve.log) is the error if it exits or does not."""
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(open(os.path.join(home, "serve.log")).read())
            time.sleep(0.05)


@contextlib.contextmanager
def another_server(binary, name, *flags):
    """A `cairn serve --e2b` of its own (a fresh state directory and token)
    started with `flags`; yields its url, key and home, and removes what it
    made when done."""
    home = tempfile.mkdtemp(prefix=f"cairn-e2b-{name}-")
    env = dict(os.environ, CAIRN_HOME=home)
    token = subprocess.run(
        [binary, "token", "create", name], env=env, check=True, capture_output=True, text=True
    ).stdout
    key = next(w for w in token.split() if len(w) >= 20)
    port = _free_port()
    log = open(os.path.join(home, "serve.log"), "a")
    # The tiny base unless the test asks for E2B's Debian one.
    base = [] if "--e2b-base" in flags else ["--e2b-base", "busybox"]
    server = subprocess.Popen(
        [binary, "serve", "--e2b", f"127.0.0.1:{port}", *base, *flags],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_until_listening(server, port, home)
        yield {"url": f"http://127.0.0.1:{port}", "key": key, "home": home}
    finally:
        server.terminate()
        server.wait(timeout=30)
        ids = subprocess.run([binary, "ps", "-q"], env=env, capture_output=True, text=True).stdout.split()
        if ids:
            subprocess.run([binary, "rm", "--force", *ids], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def server_of_its_own(cairn_e2b):
    """[`another_server`] for a test module (`conftest` cannot be imported by
    name: with several test directories in one run it names another's)."""
    return lambda name, *flags: another_server(cairn_e2b["bin"], name, *flags)


def _runsc_missing():
    runsc = os.environ.get("CAIRN_RUNSC") or shutil.which("runsc")
    return not runsc or not os.path.isfile(runsc)


@pytest.fixture
def needs_runsc():
    """Skips a gVisor test, loudly, where runsc is missing; under CI=true it fails."""
    if _runsc_missing():
        message = "runsc (gVisor) is not installed: apt-get install runsc, or set CAIRN_RUNSC"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message} (CI=true: a missing part fails the test)")
        warnings.warn(f"SKIPPED the gVisor E2B tests: {message}")
        pytest.skip(message)


@pytest.fixture(scope="session", autouse=True)
def cairn_e2b():
    binary = os.environ.get("CAIRN_BIN") or str(REPO / "target" / _host_tuple() / "debug" / "cairn")
    if not os.path.exists(binary):
        pytest.fail(f"no cairn binary at {binary}: build it or set CAIRN_BIN")
    home = tempfile.mkdtemp(prefix="cairn-e2b-")
    env = dict(os.environ, CAIRN_HOME=home)
    token = subprocess.run(
        [binary, "token", "create", "e2b-tests"], env=env, check=True, capture_output=True, text=True
    ).stdout
    secret = next(w for w in token.split() if len(w) >= 20)
    subprocess.run(
        [binary, "image", "build", "busybox", "--name", GVISOR_TEMPLATE], env=env, check=True, capture_output=True
    )
    port = _free_port()
    log = open(os.path.join(home, "serve.log"), "a")
    _SERVER_LOGS[home] = log.name
    server = {}

    def start():
        server["p"] = subprocess.Popen(
            [binary, "serve", "--e2b", f"127.0.0.1:{port}", "--e2b-base", "busybox",
             "--e2b-driver", f"{GVISOR_TEMPLATE}=gvisor",
             "--e2b-driver", f"{GVISOR_INTERPRETER}=gvisor"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _wait_until_listening(server["p"], port, home)

    def stop():
        server["p"].terminate()
        try:
            server["p"].wait(timeout=30)
        except subprocess.TimeoutExpired:
            server["p"].kill()
            server["p"].wait()

    def restart():
        stop()
        start()

    start()
    url = f"http://127.0.0.1:{port}"
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=secret)
    os.environ.pop("E2B_DEBUG", None)
    yield {
        "url": url,
        "key": secret,
        "home": home,
        "bin": binary,
        "restart": restart,
        "pid": lambda: server["p"].pid,
    }
    stop()
    _SERVER_LOGS.pop(home, None)
    # Sandboxes outlive the server; remove them with their state directory.
    ids = subprocess.run([binary, "ps", "-q"], env=env, capture_output=True, text=True).stdout.split()
    if ids:
        subprocess.run([binary, "rm", "--force", *ids], env=env, capture_output=True)
    shutil.rmtree(home, ignore_errors=True)
