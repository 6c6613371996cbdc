"""Starts the scripted model server (`cairn-scripted-model`, from the
cairn-testkit crate) with a script per test, for the official `anthropic`
and `openai` packages to talk to.

The binary is $CAIRN_SCRIPTED_MODEL, else target/<host tuple>/debug/cairn-scripted-model
(build it with `cargo build -p cairn-testkit --bins`; this builds nothing)."""

import json
import os
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _host_tuple():
    """Cargo's output directory under target/ (.cargo/config.toml names the host as the target)."""
    return subprocess.run(["rustc", "--print", "host-tuple"], check=True, capture_output=True, text=True).stdout.strip()


class Server:
    def __init__(self, process, url):
        self.process = process
        self.url = url

    def recorded(self):
        with urllib.request.urlopen(self.url + "/_requests", timeout=10) as answer:
            return json.load(answer)

    def requests(self):
        return self.recorded()["requests"]

    def violations(self):
        return self.recorded()["violations"]


@pytest.fixture(scope="session")
def binary():
    path = os.environ.get("CAIRN_SCRIPTED_MODEL") or str(REPO / "target" / _host_tuple() / "debug" / "cairn-scripted-model")
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"no cairn-scripted-model binary at {path}: run `cargo build -p cairn-testkit --bins` "
            "or set CAIRN_SCRIPTED_MODEL"
        )
    return path


@pytest.fixture
def scripted(binary):
    """scripted(script) -> Server: a server playing `script` until the test ends."""
    started = []

    def start(script):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(script, f)
        process = subprocess.Popen(
            [binary, "--script", f.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append((process, f.name))
        line = process.stdout.readline().strip()
        if not line.startswith("listening http://"):
            process.kill()
            raise RuntimeError(f"cairn-scripted-model did not start: {line!r} {process.stderr.read()}")
        return Server(process, line.split()[1])

    yield start
    for process, script in started:
        process.kill()
        process.wait()
        os.unlink(script)
