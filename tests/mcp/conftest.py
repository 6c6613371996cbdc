"""Starts Cairn's MCP server on a fresh state directory, both ways: `cairn
mcp` over stdio (a process per client) and `/mcp` on `cairn serve --listen`
(Streamable HTTP, bearer token required), for the official `mcp` client.

The binary is $CAIRN_BIN, else target/<host tuple>/debug/cairn (this builds nothing).
Needs root: the sandboxes are real."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

# The CLI acts as CAIRN_TOKEN's holder: these tests' commands are the
# administrator's unless a test gives a token.
os.environ.pop("CAIRN_TOKEN", None)

REPO = Path(__file__).resolve().parents[2]


def _host_tuple():
    """Cargo's output directory under target/ (.cargo/config.toml names the host as the target)."""
    return subprocess.run(["rustc", "--print", "host-tuple"], check=True, capture_output=True, text=True).stdout.strip()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cairn():
    binary = os.environ.get("CAIRN_BIN") or str(REPO / "target" / _host_tuple() / "debug" / "cairn")
    if not os.path.exists(binary):
        pytest.fail(f"no cairn binary at {binary}: build it or set CAIRN_BIN")
    home = tempfile.mkdtemp(prefix="cairn-mcp-")
    env = dict(os.environ, CAIRN_HOME=home)

    def cli(*args):
        return subprocess.run([binary, *args], env=env, check=True, capture_output=True, text=True).stdout

    token = cli("token", "create", "mcp-tests")
    secret = next(w for w in token.split() if len(w) >= 20)
    # The snapshot every test starts from: /work/seed holds "seed".
    box = cli("create").split()[-1]
    cli("exec", box, "--", "sh", "-c", "mkdir -p /work && echo seed > /work/seed")
    seed = cli("snapshot", box, "--label", "seed").split()[-1]
    cli("rm", "--force", box)
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
    yield {
        "bin": binary,
        "home": home,
        "env": env,
        "cli": cli,
        "seed": seed,
        "url": f"http://127.0.0.1:{port}/mcp",
        "token": secret,
    }
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    ids = subprocess.run([binary, "ps", "-q"], env=env, capture_output=True, text=True).stdout.split()
    if ids:
        subprocess.run([binary, "rm", "--force", *ids], env=env, capture_output=True)
    shutil.rmtree(home, ignore_errors=True)
