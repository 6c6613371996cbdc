"""The E2B target of `cairn bench api`, measured through the real e2b SDK:
`Sandbox.create()` + `commands.run("echo hi")`, median and p95 over N runs
(the sandbox is killed after each, not timed).

    python -m venv v && v/bin/pip install e2b==2.63.0
    v/bin/python scripts/bench-e2b.py [RUNS] [SERVE FLAGS...]   # CAIRN_BIN: default target/<host tuple>/release/cairn
    v/bin/python scripts/bench-e2b.py 50 --e2b-network egress   # sandboxes with a route out

Starts its own `cairn serve --e2b` on a scratch state directory seeded with
the busybox image, as root."""

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _host_tuple():
    """Cargo's output directory under target/ (.cargo/config.toml names the host as the target)."""
    return subprocess.run(["rustc", "--print", "host-tuple"], check=True, capture_output=True, text=True).stdout.strip()


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    flags = sys.argv[2:]
    # Measured on the tiny base unless told otherwise (`--e2b-base debian`).
    base = [] if "--e2b-base" in flags else ["--e2b-base", "busybox"]
    binary = os.environ.get("CAIRN_BIN") or str(REPO / "target" / _host_tuple() / "release" / "cairn")
    home = tempfile.mkdtemp(prefix="cairn-bench-e2b-")
    env = dict(os.environ, CAIRN_HOME=home)
    env.pop("CAIRN_STATE", None)
    subprocess.run([binary, "image", "build", "busybox"], env=env, check=True, capture_output=True)
    secret = subprocess.run(
        [binary, "token", "create", "bench"], env=env, check=True, capture_output=True, text=True
    ).stdout.strip()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [binary, "serve", "--e2b", f"127.0.0.1:{port}", *base, *flags], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise SystemExit("cairn serve --e2b did not start")
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=secret)
        os.environ.pop("E2B_DEBUG", None)
        from e2b import Sandbox

        samples = []
        for i in range(runs + 3):
            t0 = time.perf_counter()
            sb = Sandbox.create()
            out = sb.commands.run("echo hi")
            dt = (time.perf_counter() - t0) * 1e3
            assert out.stdout == "hi\n", out
            sb.kill()
            if i >= 3:
                samples.append(dt)
        samples.sort()
        p95 = samples[round((len(samples) - 1) * 0.95)]
        shown = f" (serve {' '.join(flags)})" if flags else ""
        print(f"e2b SDK{shown}: Sandbox.create() + commands.run('echo hi'): median {statistics.median(samples):.1f} ms, "
              f"p95 {p95:.1f} ms over {runs} runs (target <= 50 ms)")
    finally:
        server.terminate()
        server.wait(timeout=30)
        ids = subprocess.run([binary, "ps", "-q"], env=env, capture_output=True, text=True).stdout.split()
        if ids:
            subprocess.run([binary, "rm", "--force", *ids], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
