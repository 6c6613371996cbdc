"""Starts a real `cairn serve` for the whole session, on a fresh state
directory, listening on its Unix socket and on TCP with a token."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import cairn

REPO = Path(__file__).resolve().parents[3]


def _binary() -> str:
    path = os.environ.get("CAIRN_BIN") or str(REPO / "target" / "debug" / "cairn")
    if not os.access(path, os.X_OK):
        pytest.exit(f"no cairn binary at {path}: build it (cargo build -p cairn) or set CAIRN_BIN", 2)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary: str, home: str, port: int, token: str, proc: subprocess.Popen) -> None:
        self.binary, self.home, self.port, self.token, self.proc = binary, home, port, token, proc
        self.socket = os.path.join(home, "cairn.sock")
        self.url = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def server():
    binary = _binary()
    home = tempfile.mkdtemp(prefix="cairn-sdk-test-")
    env = {**os.environ, "CAIRN_HOME": home}
    env.pop("CAIRN_URL", None)
    env.pop("CAIRN_TOKEN", None)  # the CLI would act as its holder
    token = subprocess.run([binary, "token", "create", "sdk-tests", "--home", home], env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    port = _free_port()
    log = open(os.path.join(home, "serve.log"), "wb")
    proc = subprocess.Popen([binary, "serve", "--home", home, "--listen", f"127.0.0.1:{port}"], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    srv = Server(binary, home, port, token, proc)
    deadline = time.monotonic() + 30
    while True:
        try:
            with cairn.Client(socket=srv.socket) as c:
                c.health()
            with cairn.Client(srv.url, token=token) as c:
                c.health()
            break
        except cairn.ConnectError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                raise RuntimeError(f"cairn serve did not start: {Path(home, 'serve.log').read_text()}")
            time.sleep(0.05)
    try:
        yield srv
    finally:
        try:
            with cairn.Client(socket=srv.socket) as c:
                for sb in list(c.sandboxes.list()):
                    try:
                        sb.remove(force=True)
                    except cairn.CairnError:
                        pass
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def client(server):
    """A client on the Unix socket."""
    with cairn.Client(socket=server.socket) as c:
        yield c


@pytest.fixture(scope="session")
def tcp_client(server):
    """A client on TCP with the bearer token."""
    with cairn.Client(server.url, token=server.token) as c:
        yield c


@pytest.fixture(params=["unix", "tcp"])
def any_client(request, client, tcp_client):
    return client if request.param == "unix" else tcp_client


@pytest.fixture
def sandbox(client):
    with client.sandboxes.create() as sb:
        yield sb


@pytest.fixture
async def aclient(server):
    async with cairn.AsyncClient(socket=server.socket) as c:
        yield c
