"""Starts `cairn serve --listen` on a fresh state directory with a run made
by the CLI (a branch group with a winner, then a stage that fails into the
dead letters), for the lineage page's tests in a real headless Chromium
(Debian's `chromium`, driven by Playwright; $CAIRN_CHROMIUM names another).

The binary is $CAIRN_BIN, else target/<host tuple>/debug/cairn (this builds nothing).
Screenshots go to $CAIRN_UI_ARTIFACTS, else target/ui-artifacts. Needs root:
the sandboxes are real."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _host_tuple():
    """Cargo's output directory under target/ (.cargo/config.toml names the host as the target)."""
    return subprocess.run(["rustc", "--print", "host-tuple"], check=True, capture_output=True, text=True).stdout.strip()


PIPELINE = """
[pipeline]
name = "ui-lineage"
image = "busybox"

[[stage]]
name = "prepare"
key = "prepare-v1"
run = ["mkdir -p /work && echo prepared > /work/base"]

[[stage]]
name = "sweep"
after = "prepare"
key = "sweep-{hypothesis}"
run = ["echo {hypothesis.value} > /work/value; echo value {hypothesis.value}"]
artifacts = ["/work/value"]
[stage.branches]
select = "min"
metric = "file:/work/value"
hypotheses = [
  { name = "low", value = "2" },
  { name = "mid", value = "5" },
  { name = "high", value = "9" },
]

[[stage]]
name = "broken"
after = "sweep"
key = "broken-v1"
run = ["echo boom-marker from the broken stage; exit 3"]
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium_path():
    for p in (os.environ.get("CAIRN_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")):
        if p and os.path.exists(p):
            return p
    return None


@pytest.fixture(scope="session")
def artifacts_dir():
    d = Path(os.environ.get("CAIRN_UI_ARTIFACTS") or REPO / "target" / "ui-artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def cairn():
    binary = os.environ.get("CAIRN_BIN") or str(REPO / "target" / _host_tuple() / "debug" / "cairn")
    if not os.path.exists(binary):
        pytest.fail(f"no cairn binary at {binary}: build it or set CAIRN_BIN")
    home = tempfile.mkdtemp(prefix="cairn-ui-")
    env = dict(os.environ, CAIRN_HOME=home)
    # The embedded store: one test writes a synthetic run into its state.db.
    env.pop("CAIRN_STATE", None)
    env.pop("CAIRN_TOKEN", None)

    def cli(*args, check=True):
        return subprocess.run([binary, *args], env=env, check=check, capture_output=True, text=True)

    secret = next(w for w in cli("token", "create", "ui-tests").stdout.split() if len(w) >= 20)
    path = os.path.join(home, "ui.toml")
    with open(path, "w") as f:
        f.write(PIPELINE)
    made = cli("pipeline", "run", path, check=False)
    assert made.returncode == 1, made.stderr  # the broken stage fails the run
    run = made.stdout.split()[0]
    port = _free_port()
    log = open(os.path.join(home, "serve.log"), "a")
    server = subprocess.Popen(
        [binary, "serve", "--listen", f"127.0.0.1:{port}"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(open(os.path.join(home, "serve.log")).read())
            time.sleep(0.05)
    yield {"bin": binary, "home": home, "url": f"http://127.0.0.1:{port}", "token": secret, "run": run, "cli": cli}
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    cli("gc", check=False)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def browser():
    exe = chromium_path()
    if exe is None:
        pytest.fail("no chromium: apt-get install chromium (or set CAIRN_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()
