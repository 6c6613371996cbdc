#!/usr/bin/env python3
"""Code-interpreter service for port 49999, speaking the wire format of the
`e2b-code-interpreter` SDK and backed by Jupyter kernels (jupyter_client).

Endpoints (all JSON; errors are {"error": "..."} with 400/404/405/413/500):
  GET    /health                   -> {"status": "ok"}
  POST   /execute                  {code, context_id?, language?, env_vars?}
                                   -> 200, chunked NDJSON stream, one event a line
  GET    /contexts                 -> [{"id", "language", "cwd", "start_ms"}, ...]
  POST   /contexts                 {language?, cwd?} -> {"id", "language", "cwd", "start_ms"}
  DELETE /contexts/{id}            -> 204
  POST   /contexts/{id}/restart    -> 204

Stream events: {"type":"stdout"|"stderr","text","timestamp"(ns)},
{"type":"result", text/html/png/... , "is_main_result"},
{"type":"error","name","value","traceback"},
{"type":"number_of_executions","execution_count"}, and last
{"type":"end_of_execution"}.  The SDK ignores types it does not know.

Threading: jupyter_client's blocking API runs coroutines on a per-thread
event loop, so each context owns one worker thread that makes every
jupyter_client call for it; HTTP threads only hand it jobs and read events
back through a bounded queue.

Start-up: the first run_code waits for the default Python kernel, so that
kernel's process starts as soon as the port is bound, before this server
imports jupyter_client (which is only needed to talk to it).  Kernels are
started from their kernelspec's argv by this file (class Kernel), not by
jupyter_client's KernelManager, whose start and readiness check (an IOPub
flush that waits out a fixed 0.2 s) cost ~0.4 s more on a small host.

Runs on Debian 12's python3-jupyter-client 7.4 / python3-ipykernel 6.17 and
on current releases.  Configuration: argv [host] [port] or CODEINT_HOST,
CODEINT_PORT, CODEINT_CWD, CODEINT_OUTPUT_CAP (bytes per cell),
CODEINT_KEEPALIVE (seconds, 0 = off).
"""
import codecs
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# jupyter_client is imported where it is used (see "Start-up" above).

OUTPUT_CAP = int(os.environ.get("CODEINT_OUTPUT_CAP", 16 << 20))
# Keepalive lines are off by default: with a plain httpx transport the SDK's
# execution timeout is a per-read idle timeout, which keepalives would defeat.
KEEPALIVE = float(os.environ.get("CODEINT_KEEPALIVE", "0"))
KERNEL_START_TIMEOUT = 60.0
INTERRUPT_GRACE = 10.0  # after this, a cell ignoring SIGINT costs a restart
MAX_BODY = 64 << 20
_home = "/home/user"
DEFAULT_CWD = os.environ.get("CODEINT_CWD") or (_home if os.path.isdir(_home) else os.getcwd())

# Jupyter MIME type -> field of the SDK's Result; other types go to "extra".
MIME_FIELDS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
    "application/pdf": "pdf", "text/latex": "latex",
    "application/json": "json", "application/javascript": "javascript",
}

# Run once in each new Python kernel.  ipykernel buffers a stream until its
# next periodic flush, so a tight print loop can produce one iopub message of
# hundreds of MB.  Flushing every ~1 MiB keeps each message (and so this
# server's memory) small whatever the cell prints.  The wrapper is put on
# before every cell (pre_execute), because IPython 9 swaps sys.stdout.write
# for a wrapper of its own around each cell and puts the old one back after.
PY_SETUP = r"""
def __codeint_setup(limit=1 << 20):
    import sys
    def chunk(stream):
        write, pending = stream.write, [0]
        if getattr(write, "_codeint", False):
            return
        def chunked_write(s):
            for i in range(0, len(s), limit):  # one huge write becomes many messages
                write(s[i:i + limit])
                pending[0] += min(limit, len(s) - i)
                if pending[0] >= limit:
                    pending[0] = 0
                    stream.flush()
            return len(s)
        chunked_write._codeint = True
        stream.write = chunked_write
    def before_cell():
        for stream in (sys.stdout, sys.stderr):
            if type(stream).__module__.startswith("ipykernel"):
                chunk(stream)
    get_ipython().events.register("pre_execute", before_cell)
__codeint_setup()
del __codeint_setup
"""
# env_vars apply to one cell: set before it, restored after it.
PY_ENV_SET = ("import os as __codeint_os\n__codeint_saved = {k: __codeint_os.environ.get(k) "
              "for k in %(env)r}\n__codeint_os.environ.update(%(env)r)\n")
PY_ENV_RESTORE = ("for __k, __v in __codeint_saved.items():\n"
                  "    if __v is None: __codeint_os.environ.pop(__k, None)\n"
                  "    else: __codeint_os.environ[__k] = __v\n"
                  "del __codeint_saved, __codeint_os, __k, __v\n")


def now_ns():
    return time.time_ns()


class HTTPError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class Job:
    """One cell: the worker fills `events`; the HTTP thread drains it."""

    def __init__(self, code, env):
        self.code, self.env = code, env or {}
        self.events = queue.Queue(maxsize=256)  # bounded: back-pressure on the worker
        self.cancelled = threading.Event()      # client went away
        # bytes sent so far, streams and results budgeted apart so that a flood of
        # prints does not hide the cell's result
        self.sent = {"stream": 0, "result": 0}
        self.truncated = set()

    def emit(self, event):
        """Queue an event; give up silently once the client is gone."""
        while not self.cancelled.is_set():
            try:
                self.events.put(event, timeout=0.2)
                return
            except queue.Full:
                pass

    def output(self, kind, payload, size):
        """Emit stream/result output within the per-cell byte budget."""
        budget = "result" if kind == "result" else "stream"
        if budget in self.truncated:
            return
        room = OUTPUT_CAP - self.sent[budget]
        if size <= room:
            self.sent[budget] += size
            self.emit(payload)
            return
        self.truncated.add(budget)
        if budget == "stream" and room > 0:  # send what still fits, then one notice
            self.emit(dict(payload, text=payload["text"][:room]))
        self.emit({"type": "stderr", "timestamp": now_ns(), "text":
                   "[%s truncated: more than %d bytes; the rest of this cell's %s is "
                   "dropped]\n" % ("output" if budget == "stream" else "results",
                                    OUTPUT_CAP, budget)})


class Kernel:
    """A kernel process started from its kernelspec's argv, in a session of
    its own (an interrupt or kill reaches what the cell started), and a
    blocking client on its channels."""

    _ports_lock = threading.Lock()
    _ports_given = set()  # never hand the same port to two kernels of this server

    def __init__(self, argv, cwd, env=None, interrupt_mode="signal"):
        self.interrupt_mode = interrupt_mode
        fd, self.connection_file = tempfile.mkstemp(prefix="kernel-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(dict(self._ports(), ip="127.0.0.1", transport="tcp", key=uuid.uuid4().hex,
                           signature_scheme="hmac-sha256"), f)
        argv = [a.replace("{connection_file}", self.connection_file) for a in argv]
        # debugpy (imported by ipykernel) warns on stderr about frozen modules.
        env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1", **(env or {}))
        try:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except OSError:
            os.unlink(self.connection_file)
            raise
        self.client = None

    @classmethod
    def _ports(cls):
        names = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
        socks = []
        try:
            with cls._ports_lock:
                ports = []
                while len(ports) < len(names):
                    s = socket.socket()
                    socks.append(s)
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                    if port not in cls._ports_given:
                        cls._ports_given.add(port)
                        ports.append(port)
        finally:
            for s in socks:
                s.close()
        return dict(zip(names, ports))

    def connect(self, timeout):
        """Connects a client and waits until the kernel answers on shell and
        publishes on IOPub (so no output of the first cell is missed)."""
        from jupyter_client.blocking import BlockingKernelClient
        kc = BlockingKernelClient(connection_file=self.connection_file)
        kc.load_connection_file()
        kc.start_channels()
        self.client = kc
        deadline = time.monotonic() + timeout
        while True:
            if not self.is_alive():
                raise RuntimeError("the kernel exited with status %s while starting" % self.proc.returncode)
            if time.monotonic() > deadline:
                raise RuntimeError("the kernel did not answer within %.0fs" % timeout)
            msg_id = kc.kernel_info()
            until = time.monotonic() + 0.25
            while time.monotonic() < until:
                try:
                    msg = kc.get_iopub_msg(timeout=0.05)
                except queue.Empty:
                    continue
                if msg["parent_header"].get("msg_id") == msg_id:
                    break
            else:
                continue  # IOPub not subscribed yet, or the kernel still loading: ask again
            break
        while time.monotonic() < deadline:  # its kernel_info_reply; earlier requests' are skipped
            try:
                msg = kc.get_shell_msg(timeout=0.5)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return

    def is_alive(self):
        return self.proc.poll() is None

    def interrupt(self):
        if self.interrupt_mode == "message" and self.client is not None:
            self.client.control_channel.send(self.client.session.msg("interrupt_request", content={}))
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def shutdown(self):
        if self.client is not None:
            self.client.stop_channels()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        try:
            os.unlink(self.connection_file)
        except OSError:
            pass


class Context:
    """A kernel (or, for shell without a kernel, a subprocess runner) with its
    own worker thread.  Jobs are run one at a time, in order."""

    def __init__(self, language, cwd, kernel_name):
        self.id = uuid.uuid4().hex
        self.language, self.cwd, self.kernel_name = language, cwd, kernel_name
        self.jobs = queue.Queue()
        self.ready = threading.Event()
        self.start_error = None
        self.abort = threading.Event()  # restart/delete preempts the running cell
        self.kernel = self.kc = None
        self.needs_restart = self.closed = False
        self.count = 0                  # execution count for subprocess shells
        self.start_ms = None
        threading.Thread(target=self._run, daemon=True, name="ctx-" + self.id[:8]).start()

    def info(self):
        # start_ms: how long its kernel took to start and answer, last time.
        return {"id": self.id, "language": self.language, "cwd": self.cwd, "start_ms": self.start_ms}

    # -- worker thread ------------------------------------------------------
    def _run(self):
        try:
            self._start()
        except Exception as e:  # reported to whoever waits on `ready`
            self.start_error = "kernel failed to start: %s" % e
        self.ready.set()
        while True:
            kind, arg, done = self.jobs.get()
            try:
                if kind == "execute":
                    self._execute(arg)
                elif kind == "restart":
                    self._stop()
                    self._start()
                elif kind == "shutdown":
                    self.closed = True
                    self._stop()
                    self._fail_pending()
                    return
            except Exception as e:
                if kind == "execute":
                    arg.emit(error_event("ServerError", str(e), traceback.format_exc()))
                else:
                    arg["error"] = str(e)
            finally:
                self.abort.clear()
                if kind == "execute":
                    arg.emit(None)  # end of stream for the HTTP thread
                else:
                    done.set()

    def _fail_pending(self):
        """After shutdown: answer cells that were still queued."""
        while True:
            try:
                kind, arg, done = self.jobs.get_nowait()
            except queue.Empty:
                return
            if kind == "execute":
                arg.emit(error_event("ContextRemoved", "The context was removed.", ""))
                arg.emit(None)
            else:
                done.set()

    def _start(self):
        self.needs_restart = False
        if self.kernel_name is None:
            return  # subprocess shell: nothing to start
        started = time.monotonic()
        argv, env, interrupt_mode = REGISTRY.launch_spec(self.kernel_name)
        self.kernel = Kernel(argv, self.cwd, env, interrupt_mode)
        try:
            self.kernel.connect(KERNEL_START_TIMEOUT)
        except Exception:
            self._stop()
            raise
        self.kc = self.kernel.client
        self.start_ms = round((time.monotonic() - started) * 1e3, 1)
        if self.language == "python":
            self._silent(PY_SETUP)

    def _stop(self):
        if self.kernel is not None:
            try:
                self.kernel.shutdown()
            except Exception:
                pass
        self.kernel = self.kc = None

    def _silent(self, code, timeout=30.0):
        """Run bookkeeping code without output or history; wait for its reply."""
        msg_id = self.kc.execute(code, silent=True, store_history=False,
                                 allow_stdin=False, stop_on_error=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_shell_msg(timeout=0.5)
            except queue.Empty:
                if not self.kernel.is_alive():
                    raise RuntimeError("kernel died")
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg["content"]
        raise RuntimeError("kernel did not answer in %.0fs" % timeout)

    def _execute(self, job):
        if self.kernel_name is None:
            return self._execute_subprocess(job)
        if self.needs_restart or self.kernel is None or not self.kernel.is_alive():
            self._stop()
            self._start()  # the kernel died earlier: the state is gone anyway
        env_set = bool(job.env) and self.language == "python"
        if env_set:
            self._silent(PY_ENV_SET % {"env": {str(k): str(v) for k, v in job.env.items()}})
        msg_id = self.kc.execute(job.code, allow_stdin=False, stop_on_error=False)
        if self._collect(job, msg_id) and env_set:
            self._silent(PY_ENV_RESTORE)

    def _collect(self, job, msg_id):
        """Relay the cell's iopub messages until the kernel goes idle.
        Returns False when the kernel is gone (died, or was restarted)."""
        interrupted_at, count = None, None
        last_alive_check = time.monotonic()
        while True:
            if job.cancelled.is_set() and interrupted_at is None:
                interrupted_at = time.monotonic()
                self.kernel.interrupt()
            if interrupted_at and time.monotonic() - interrupted_at > INTERRUPT_GRACE:
                self._stop()  # the cell ignores SIGINT: give up on the kernel
                self._start()
                return False
            if self.abort.is_set():
                job.emit(error_event("ContextRestarted", "The context was restarted or "
                                     "removed while this cell was running.", ""))
                return False
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if time.monotonic() - last_alive_check >= 0.5:
                    last_alive_check = time.monotonic()
                    if not self.kernel.is_alive():
                        self.needs_restart = True
                        job.emit(error_event(
                            "KernelDied", "The kernel died while running this cell "
                            "(e.g. os._exit, a crash or out of memory); its state is lost. "
                            "The next execution in this context starts a fresh kernel, or "
                            "restart it with POST /contexts/%s/restart." % self.id, ""))
                        return False
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue  # leftovers of an earlier (interrupted) cell
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                name = "stderr" if content.get("name") == "stderr" else "stdout"
                text = content.get("text", "")
                job.output(name, {"type": name, "text": text, "timestamp": now_ns()}, len(text))
            elif kind in ("execute_result", "display_data"):
                event, size = result_event(content.get("data", {}), kind == "execute_result")
                job.output("result", event, size)
            elif kind == "error":
                job.emit(error_event(content.get("ename", ""), content.get("evalue", ""),
                                     "\n".join(content.get("traceback", []))))
            elif kind == "execute_input":
                count = content.get("execution_count")
            elif kind == "status" and content.get("execution_state") == "idle":
                if count is not None:
                    job.emit({"type": "number_of_executions", "execution_count": count})
                self._drain_reply(msg_id)
                return True

    def _drain_reply(self, msg_id):
        """Read the execute_reply off the shell socket so replies don't pile up."""
        for _ in range(10):
            try:
                msg = self.kc.get_shell_msg(timeout=0.5)
            except queue.Empty:
                return
            if msg["parent_header"].get("msg_id") == msg_id:
                return

    def _execute_subprocess(self, job):
        """Shell without a kernel: one `bash -c` per cell, output streamed.
        Shell state (variables, cd) does not persist between cells."""
        self.needs_restart = False
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in job.env.items()})
        shell = shutil.which("bash") or "/bin/sh"
        proc = subprocess.Popen([shell, "-c", job.code], cwd=self.cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        self.count += 1
        streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in streams}
        open_fds = set(streams)
        try:
            while open_fds:
                if job.cancelled.is_set() or self.abort.is_set():
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                readable, _, _ = select.select(list(open_fds), [], [], 0.2)
                for fd in readable:
                    data = os.read(fd, 65536)
                    if not data:
                        open_fds.discard(fd)
                    text = decoders[fd].decode(data, final=not data)
                    if not text:
                        continue
                    job.output(streams[fd], {"type": streams[fd], "text": text,
                                             "timestamp": now_ns()}, len(data))
        finally:
            code = proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        if code != 0 and not job.cancelled.is_set():
            job.emit(error_event("ShellError", "exit status %d" % code, ""))
        job.emit({"type": "number_of_executions", "execution_count": self.count})

    # -- called from HTTP threads -------------------------------------------
    def submit(self, kind, arg=None, timeout=KERNEL_START_TIMEOUT + 30):
        if self.closed:
            raise HTTPError(404, "context %r was removed" % self.id)
        done = threading.Event()
        if kind in ("restart", "shutdown"):
            self.abort.set()  # preempt a running cell
        self.jobs.put((kind, arg, done))
        if kind != "execute" and not done.wait(timeout):
            raise HTTPError(500, "timed out waiting for the context to %s" % kind)


def error_event(name, value, tb):
    cap = 1 << 20  # an exception message can be huge; keep the event bounded
    return {"type": "error", "name": str(name)[:cap], "value": str(value)[:cap],
            "traceback": str(tb)[-cap:]}


def result_event(data, is_main):
    event = {"type": "result", "is_main_result": is_main}
    extra, size = {}, 0
    for mime, value in data.items():
        size += len(value) if isinstance(value, str) else len(json.dumps(value))
        if mime in MIME_FIELDS:
            event[MIME_FIELDS[mime]] = value
        else:
            extra[mime] = value
    if extra:
        event["extra"] = extra
    return event, size


class Registry:
    """All contexts, plus the default context of each language."""

    def __init__(self):
        self.lock = threading.Lock()
        self.contexts = {}
        self.defaults = {}
        self.specs = None

    def kernel_for(self, language):
        """Kernel name for a language; None means subprocess shell."""
        if language == "python":
            return "python3"  # the native kernel: always there with ipykernel
        if self.specs is None:
            from jupyter_client.kernelspec import KernelSpecManager
            self.specs = KernelSpecManager().get_all_specs()
        for name, spec in sorted(self.specs.items()):
            if spec.get("spec", {}).get("language", "").lower() == language or name == language:
                return name
        if language == "bash":
            return None
        raise HTTPError(400, "language %r is not supported here" % language)

    def launch_spec(self, kernel_name):
        """(argv, env, interrupt mode) that start kernel `kernel_name`."""
        if kernel_name == "python3":  # ipykernel's own spec, known without a lookup
            return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"], None, "signal"
        from jupyter_client.kernelspec import KernelSpecManager
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
        return spec.argv, spec.env, spec.interrupt_mode

    def create(self, language, cwd):
        language = normalize_language(language)
        cwd = cwd or DEFAULT_CWD
        if not os.path.isdir(cwd):
            raise HTTPError(400, "cwd %r is not a directory" % cwd)
        ctx = Context(language, cwd, self.kernel_for(language))
        with self.lock:
            self.contexts[ctx.id] = ctx
        self.wait_ready(ctx)
        return ctx

    def wait_ready(self, ctx):
        if not ctx.ready.wait(KERNEL_START_TIMEOUT + 10):
            raise HTTPError(500, "kernel did not start in time")
        if ctx.start_error:
            with self.lock:  # forget it, so that the next request tries afresh
                self.contexts.pop(ctx.id, None)
                if self.defaults.get(ctx.language) == ctx.id:
                    del self.defaults[ctx.language]
            raise HTTPError(500, ctx.start_error)

    def default(self, language):
        language = normalize_language(language)
        with self.lock:
            ctx = self.contexts.get(self.defaults.get(language, ""))
            if ctx is None:
                ctx = Context(language, DEFAULT_CWD, self.kernel_for(language))
                self.contexts[ctx.id] = ctx
                self.defaults[language] = ctx.id
        self.wait_ready(ctx)
        return ctx

    def get(self, context_id):
        with self.lock:
            ctx = self.contexts.get(context_id)
        if ctx is None:
            raise HTTPError(404, "context %r not found" % context_id)
        return ctx

    def remove(self, context_id):
        with self.lock:
            ctx = self.contexts.pop(context_id, None)
        if ctx is None:
            raise HTTPError(404, "context %r not found" % context_id)
        ctx.submit("shutdown", {})

    def all(self):
        with self.lock:
            return list(self.contexts.values())


def normalize_language(language):
    language = (language or "python").strip().lower()
    return {"python3": "python", "py": "python", "sh": "bash", "shell": "bash"}.get(language, language)


REGISTRY = Registry()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked streaming
    server_version = "codeint/1"

    def setup(self):
        super().setup()
        # Events are small writes; without this, Nagle + delayed ACK add ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):
        if os.environ.get("CODEINT_LOG"):
            super().log_message(fmt, *args)

    def do_GET(self):
        self._dispatch(self.command)

    do_POST = do_DELETE = do_GET

    def _dispatch(self, method):
        parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
        self.body_read = False
        try:
            if parts == ["health"] and method == "GET":
                return self._json(200, {"status": "ok"})
            if parts == ["execute"] and method == "POST":
                return self._execute(self._body())
            if parts == ["contexts"] and method == "GET":
                return self._json(200, [c.info() for c in REGISTRY.all()])
            if parts == ["contexts"] and method == "POST":
                body = self._body(optional=True)
                ctx = REGISTRY.create(body.get("language"), body.get("cwd"))
                return self._json(200, ctx.info())
            if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
                REGISTRY.remove(parts[1])
                return self._empty(204)
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" \
                    and method == "POST":
                self._body(optional=True)
                ctx = REGISTRY.get(parts[1])
                result = {}
                ctx.submit("restart", result)
                if result.get("error"):
                    raise HTTPError(500, "restart failed: " + result["error"])
                return self._empty(204)
            known = parts in (["health"], ["execute"], ["contexts"]) or \
                (parts[:1] == ["contexts"] and len(parts) in (2, 3))
            raise HTTPError(405 if known else 404, "no route for %s %s" % (method, self.path))
        except HTTPError as e:
            if not self.body_read:  # an unread body would garble the next request
                self.close_connection = True
            self._json(e.status, {"error": str(e)})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:
            traceback.print_exc()
            self._json(500, {"error": "internal error: %s" % e})

    def _body(self, optional=False):
        self.body_read = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                if len(raw) + size > MAX_BODY:
                    self.close_connection = True
                    raise HTTPError(413, "request body too large")
                raw += self.rfile.read(size)
                self.rfile.readline()
        else:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self.close_connection = True
                raise HTTPError(413, "request body too large")
            raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            if optional:
                return {}
            raise HTTPError(400, "request body must be a JSON object")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise HTTPError(400, "invalid JSON body: %s" % e)
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _empty(self, status):
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _execute(self, body):
        code, context_id, language = body.get("code"), body.get("context_id"), body.get("language")
        env = body.get("env_vars") or {}
        if not isinstance(code, str):
            raise HTTPError(400, "'code' must be a string")
        if not isinstance(env, dict):
            raise HTTPError(400, "'env_vars' must be an object")
        if context_id and language:
            raise HTTPError(400, "give context_id or language, not both")
        ctx = REGISTRY.get(context_id) if context_id else REGISTRY.default(language)
        job = Job(code, env)
        ctx.submit("execute", job)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Accel-Buffering", "no")
        self.end_headers()
        self.wfile.flush()
        try:
            self._stream(job)
        except (BrokenPipeError, ConnectionResetError, OSError):
            job.cancelled.set()  # the worker interrupts the kernel
            self.close_connection = True

    def _stream(self, job):
        last_write = time.monotonic()
        while True:
            try:
                event = job.events.get(timeout=0.2)
            except queue.Empty:
                if self._client_gone():
                    raise BrokenPipeError("client closed the connection")
                if KEEPALIVE and time.monotonic() - last_write >= KEEPALIVE:
                    self._chunk(b'{"type":"keepalive"}\n')
                    last_write = time.monotonic()
                continue
            if event is None:
                end = b'{"type":"end_of_execution"}\n'
                self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(end), end))
                return
            self._chunk(json.dumps(event).encode() + b"\n")
            last_write = time.monotonic()

    def _chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _client_gone(self):
        """True when the peer has closed its end.  HTTP/1.1 clients send nothing
        while awaiting a response, so a readable socket with no data is EOF."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


def main():
    host = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("CODEINT_HOST", "0.0.0.0")
    port = int(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("CODEINT_PORT", "49999"))
    # Bound first: a second server (the port taken) exits before it starts
    # a kernel.  Then the default Python kernel: the first run_code waits
    # for it.
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=lambda: REGISTRY.default("python"), daemon=True).start()
    print("codeint listening on %s:%d" % (host, port), flush=True)

    def stop(*_):
        threading.Thread(target=server.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        for ctx in REGISTRY.all():  # don't leave kernels behind
            try:
                ctx.submit("shutdown", {}, timeout=10)
            except HTTPError:
                pass


if __name__ == "__main__":
    main()
