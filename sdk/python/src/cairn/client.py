"""The synchronous client."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import httpx

from . import _config as cfg
from . import errors
from ._sse import events as sse_events
from .models import (Artifact, DeadLetter, Event, ExecResult, FileStat, ForkResult, Health, Image, LogEntry,
                     Output, RecoverResult, Rewind, Run, RunAudit, RunDetail, Sandbox, Session,
                     SessionExecResult, Snapshot, SnapshotDetail, SnapshotDiff, Verification)


class Client:
    """A connection to `cairn serve`.

    By default it talks to the Unix socket `$CAIRN_HOME/cairn.sock` (home
    `~/.local/share/cairn`); when `CAIRN_URL` is set, to that URL with
    `CAIRN_TOKEN` as the bearer token. Arguments override the environment:
    `socket` or `home` for a socket, `url` and `token` for TCP.
    """

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *, socket: Optional[str] = None,
                 home: Optional[str] = None, timeout: Any = None,
                 transport: Optional[httpx.BaseTransport] = None) -> None:
        self._target = cfg.resolve(url, token, socket, home)
        if transport is None and self._target.socket:
            transport = httpx.HTTPTransport(uds=self._target.socket)
        self._http = httpx.Client(transport=transport, **cfg.client_kwargs(self._target, timeout))
        self.sandboxes = Sandboxes(self)
        self.snapshots = Snapshots(self)
        self.images = Images(self)
        self.runs = Runs(self)
        self.artifacts = Artifacts(self)
        self.dlq = DeadLetters(self)
        self.sessions = Sessions(self)

    @property
    def where(self) -> str:
        """The socket or URL this client talks to."""
        return self._target.where

    # Plumbing -----------------------------------------------------------

    def _send(self, method: str, path: str, *, stream: bool = False, **kw: Any) -> httpx.Response:
        try:
            req = self._http.build_request(method, path, **kw)
            resp = self._http.send(req, stream=stream)
        except httpx.TransportError as e:
            raise errors.from_transport(e, self.where) from None
        if resp.status_code >= 400:
            try:
                body = resp.read()
            except httpx.TransportError:
                body = b""
            finally:
                resp.close()
            raise errors.from_response(resp.status_code, body)
        return resp

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self._send(method, path, **kw)
        return resp.json() if resp.content else None

    def _pages(self, path: str, params: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        params = {k: v for k, v in params.items() if v is not None}
        while True:
            page = self._json("GET", path, params=params)
            yield from page.get("items", [])
            nxt = page.get("next")
            if not nxt:
                return
            params["after"] = nxt

    def _sse(self, method: str, path: str, **kw: Any) -> Iterator[Any]:
        resp = self._send(method, path, stream=True, **kw)
        try:
            yield from sse_events(resp.iter_lines())
        except httpx.TransportError as e:
            raise errors.from_transport(e, self.where) from None
        finally:
            resp.close()

    def request(self, method: str, path: str, **kw: Any) -> Any:
        """Calls any route (e.g. one newer than this SDK) and answers its
        JSON, or None when it has no body; keyword arguments go to httpx
        (`json=`, `params=`, `content=`, `headers=`)."""
        return self._json(method, path, **kw)

    # System -------------------------------------------------------------

    def health(self) -> Health:
        return Health.from_dict(self._json("GET", "/healthz"))

    def metrics(self) -> str:
        """The Prometheus text exposition."""
        return self._send("GET", "/metrics").text

    def openapi(self) -> Dict[str, Any]:
        return self._json("GET", "/v1/openapi.json")

    def events(self) -> Iterator[Event]:
        """Events as they happen, forever (break out of the loop to stop)."""
        for kind, data in self._sse("GET", "/v1/events", timeout=httpx.Timeout(30.0, read=None)):
            if isinstance(data, dict) and "id" in data:
                yield Event.from_dict(data)
            else:
                yield Event(kind=kind, detail=str(data))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_STARTED = Output(stream="started", data=b"")


class ExecStream:
    """A running command's output: iterate for `Output` pieces as they
    happen; afterwards `.result` is the ExecResult. `started()` waits for
    the process and answers its pid (for `signal` or `write_stdin`).
    Leaving the loop (or closing the stream) before the end kills the
    process."""

    _result_type: Any = ExecResult

    def __init__(self, client: Client, resp: httpx.Response) -> None:
        self._client, self._resp = client, resp
        self._events = sse_events(resp.iter_lines())
        self._early: List[Output] = []
        self.pid: Optional[int] = None
        self.result: Optional[ExecResult] = None

    def _next(self) -> Optional[Output]:
        """The next piece of output, or None at the end."""
        try:
            for kind, data in self._events:
                if kind in ("stdout", "stderr"):
                    return Output.from_event(kind, data)
                if kind == "started":
                    self.pid = data.get("pid")
                    return _STARTED
                elif kind == "exit":
                    self.result = self._result_type.from_dict(data)
                    if self.pid is None:
                        self.pid = getattr(self.result, "pid", None)
                    return None
                elif kind == "error":
                    raise errors.from_event(data)
        except httpx.TransportError as e:
            raise errors.from_transport(e, self._client.where) from None
        if self.result is None:
            raise errors.CairnError("the exec stream ended before the process did", code="stream_ended")
        return None

    def started(self) -> int:
        """Waits until the process runs and answers its pid."""
        while self.pid is None and self.result is None:
            out = self._next()
            if out is None:
                break
            if out is not _STARTED:
                self._early.append(out)
        assert self.pid is not None
        return self.pid

    def __iter__(self) -> Iterator[Output]:
        try:
            while self._early:
                yield self._early.pop(0)
            while self.result is None:
                out = self._next()
                if out is None:
                    return
                if out is not _STARTED:
                    yield out
        finally:
            # Leaving the loop early ends the stream, and so the process.
            self._resp.close()

    def wait(self) -> ExecResult:
        """Drains the output and answers how the process ended."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        self._resp.close()

    def __enter__(self) -> "ExecStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Sandboxes:
    def __init__(self, client: Client) -> None:
        self._c = client

    def _bind(self, data: Dict[str, Any]) -> Sandbox:
        return Sandbox.from_dict(data, _ops=self)

    def create(self, image: Optional[str] = None, snapshot: Any = None, driver: Optional[str] = None,
               name: Optional[str] = None, memory: Any = None, cpus: Any = None, pids: Optional[int] = None,
               services: Optional[List[str]] = None, idempotency_key: Optional[str] = None,
               wait: Optional[float] = None, priority: Optional[int] = None) -> Sandbox:
        """Starts a sandbox from an image (default busybox) or a snapshot.
        Past the server's capacity it waits its turn (higher `priority`
        first) for at most `wait` seconds (the server's default: 300), then
        raises `NoCapacity`."""
        body = cfg.create_body(image, snapshot, driver, name, memory, cpus, pids, services)
        return self._bind(self._c._json("POST", "/v1/sandboxes", json=body,
                                        headers=cfg.admission_headers(idempotency_key, wait, priority)))

    def list(self, state: Optional[str] = None, image: Optional[str] = None) -> Iterator[Sandbox]:
        """Every sandbox (all pages), oldest first."""
        for item in self._c._pages("/v1/sandboxes", {"state": state, "image": image}):
            yield self._bind(item)

    def get(self, id: str) -> Sandbox:
        return self._bind(self._c._json("GET", f"/v1/sandboxes/{cfg.ident(id)}"))

    def remove(self, id: Any, force: bool = False) -> None:
        self._c._send("DELETE", f"/v1/sandboxes/{cfg.ident(id)}", params={"force": "true"} if force else None)

    def exec(self, id: str, argv: Any, *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
             timeout: Optional[float] = None, stdin: Optional[str] = None) -> ExecResult:
        body = cfg.exec_body(argv, env, cwd, timeout, stdin)
        return ExecResult.from_dict(self._c._json("POST", f"/v1/sandboxes/{id}/exec", json=body))

    def exec_stream(self, id: str, argv: Any, *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                    timeout: Optional[float] = None, stdin: Optional[str] = None) -> ExecStream:
        body = cfg.exec_body(argv, env, cwd, timeout, stdin)
        return ExecStream(self._c, self._c._send("POST", f"/v1/sandboxes/{id}/exec/stream", json=body,
                                                 stream=True))

    def write_file(self, id: str, path: str, data: Any, mode: int = 0o644) -> FileStat:
        raw = cfg.text_bytes(data)
        content = raw if raw is not None else cfg.file_chunks(data)
        return FileStat.from_dict(self._c._json(
            "PUT", f"/v1/sandboxes/{id}/files", params={"path": path, "mode": format(mode, "o")},
            content=content, headers={"Content-Type": "application/octet-stream"}))

    def _download(self, id: str, path: str) -> httpx.Response:
        return self._c._send("GET", f"/v1/sandboxes/{id}/files", params={"path": path}, stream=True)

    def read_file(self, id: str, path: str) -> bytes:
        resp = self._download(id, path)
        try:
            return b"".join(resp.iter_bytes())
        except httpx.TransportError as e:
            raise errors.CairnError(f"reading {path} was cut short: {e}", code="transport") from None
        finally:
            resp.close()

    def download(self, id: str, path: str, dest: Any) -> int:
        resp = self._download(id, path)
        try:
            return _save(resp, resp.iter_bytes(), dest, path)
        except httpx.TransportError as e:
            raise errors.CairnError(f"downloading {path} was cut short: {e}", code="transport") from None
        finally:
            resp.close()

    def stat(self, id: str, path: str) -> FileStat:
        return FileStat.from_dict(self._c._json("GET", f"/v1/sandboxes/{id}/files/stat", params={"path": path}))

    def snapshot(self, id: str, label: Optional[str] = None) -> Snapshot:
        body = {"label": label} if label is not None else {}
        return Snapshot.from_dict(self._c._json("POST", f"/v1/sandboxes/{id}/snapshots", json=body))

    def fork(self, id: str, count: int = 1, *, idempotency_key: Optional[str] = None) -> ForkResult:
        """Snapshots the sandbox and starts `count` sandboxes from it."""
        return ForkResult.from_dict(self._c._json("POST", f"/v1/sandboxes/{id}/fork", json={"count": count},
                                                  headers=cfg.key_header(idempotency_key)), _ops=self)

    def reset(self, id: str, snapshot: Any) -> Sandbox:
        return self._bind(self._c._json("POST", f"/v1/sandboxes/{id}/reset",
                                        json={"snapshot": cfg.ident(snapshot)}))

    def signal(self, id: str, pid: int, sig: Any) -> None:
        self._c._send("POST", f"/v1/sandboxes/{id}/processes/{int(pid)}/signal", json={"signal": sig})

    def write_stdin(self, id: str, pid: int, data: Any, close: bool = False) -> None:
        body: Dict[str, Any] = {"close": close}
        if isinstance(data, str):
            body["data"] = data
        elif data is not None:
            import base64
            body["data_base64"] = base64.b64encode(bytes(data)).decode()
        self._c._send("POST", f"/v1/sandboxes/{id}/processes/{int(pid)}/stdin", json=body)


def _save(resp: httpx.Response, chunks: Iterator[bytes], dest: Any, path: str) -> int:
    n = 0
    if hasattr(dest, "write"):
        for b in chunks:
            dest.write(b)
            n += len(b)
        return n
    tmp = f"{os.fspath(dest)}.part"
    with open(tmp, "wb") as f:
        for b in chunks:
            f.write(b)
            n += len(b)
    mode = resp.headers.get("x-cairn-mode")
    if mode:
        os.chmod(tmp, int(mode, 8))
    os.replace(tmp, dest)
    return n


class Snapshots:
    def __init__(self, client: Client) -> None:
        self._c = client

    def list(self) -> Iterator[Snapshot]:
        for item in self._c._pages("/v1/snapshots", {}):
            yield Snapshot.from_dict(item)

    def get(self, id: Any) -> SnapshotDetail:
        return SnapshotDetail.from_dict(self._c._json("GET", f"/v1/snapshots/{cfg.ident(id)}"))

    def remove(self, id: Any) -> None:
        self._c._send("DELETE", f"/v1/snapshots/{cfg.ident(id)}")

    def verify(self, id: Any, *, repair: bool = False) -> Dict[str, Any]:
        """`cairn verify` of one snapshot: the report (`ok`, `damaged`, ...)."""
        return self._c._json("POST", f"/v1/snapshots/{cfg.ident(id)}/verify", json={"repair": repair})

    def diff(self, a: Any, b: Any, *, text_max: Optional[int] = None,
             max_changes: Optional[int] = None) -> SnapshotDiff:
        """How `b` differs from `a`: each a snapshot (record, id or label),
        a sandbox (its files as they are now) or "RUN/STAGE[.BRANCH]"."""
        return SnapshotDiff.from_dict(self._c._json("GET", "/v1/diff", params=cfg.diff_params(a, b, text_max,
                                                                                              max_changes)))

    def fork(self, id: Any, count: int = 1, *, driver: Optional[str] = None, memory: Any = None, cpus: Any = None,
             pids: Optional[int] = None, idempotency_key: Optional[str] = None) -> ForkResult:
        """Starts `count` sandboxes from the snapshot."""
        body: Dict[str, Any] = {"count": count}
        if driver:
            body["driver"] = driver
        limits = cfg.limits_body(memory, cpus, pids)
        if limits:
            body["limits"] = limits
        return ForkResult.from_dict(self._c._json("POST", f"/v1/snapshots/{cfg.ident(id)}/fork", json=body,
                                                  headers=cfg.key_header(idempotency_key)),
                                    _ops=self._c.sandboxes)

    def restore(self, id: Any, *, name: Optional[str] = None, driver: Optional[str] = None, memory: Any = None,
                cpus: Any = None, pids: Optional[int] = None) -> Sandbox:
        """Starts one sandbox from the snapshot."""
        body: Dict[str, Any] = {k: v for k, v in (("name", name), ("driver", driver)) if v is not None}
        limits = cfg.limits_body(memory, cpus, pids)
        if limits:
            body["limits"] = limits
        return self._c.sandboxes._bind(self._c._json("POST", f"/v1/snapshots/{cfg.ident(id)}/restore", json=body))


class Images:
    def __init__(self, client: Client) -> None:
        self._c = client

    def list(self) -> List[Image]:
        return [Image.from_dict(i) for i in self._c._json("GET", "/v1/images")]

    def build(self, name: str, kind: str = "busybox", *, packages: Optional[List[str]] = None,
              suite: Optional[str] = None, on_step: Optional[Callable[[str], Any]] = None) -> Image:
        """Builds an image (`busybox` or `debian`); `on_step` hears each step."""
        body: Dict[str, Any] = {"name": name, "kind": kind}
        if packages:
            body["packages"] = list(packages)
        if suite:
            body["suite"] = suite
        for ev, data in self._c._sse("POST", "/v1/images", json=body):
            if ev == "step" and on_step is not None:
                on_step(data.get("message", "") if isinstance(data, dict) else str(data))
            elif ev == "image":
                return Image.from_dict(data)
            elif ev == "error":
                raise errors.from_event(data)
        raise errors.CairnError("the image build stream ended without an image", code="stream_ended")

    def import_tar(self, name: str, tar: Any) -> Image:
        """Imports a root filesystem tar archive (a local path or a binary file object)."""
        if hasattr(tar, "read"):
            return Image.from_dict(self._c._json("POST", "/v1/images/import", params={"name": name},
                                                 content=cfg.file_chunks(tar),
                                                 headers={"Content-Type": "application/x-tar"}))
        with open(tar, "rb") as f:
            return self.import_tar(name, f)

    def remove(self, name: str) -> None:
        self._c._send("DELETE", f"/v1/images/{name}")


class Runs:
    def __init__(self, client: Client) -> None:
        self._c = client

    def start(self, pipeline: str, params: Optional[Dict[str, str]] = None, *, file: Optional[str] = None,
              queue: bool = False, idempotency_key: Optional[str] = None) -> Run:
        """Starts a pipeline run from the pipeline file's TOML text; with
        `queue`, the stage queue's workers run it (docs/cluster.md)."""
        body: Dict[str, Any] = {"pipeline": pipeline}
        if params:
            body["params"] = {k: str(v) for k, v in params.items()}
        if file:
            body["file"] = file
        if queue:
            body["queue"] = True
        return Run.from_dict(self._c._json("POST", "/v1/runs", json=body, headers=cfg.key_header(idempotency_key)))

    def list(self) -> Iterator[Run]:
        for item in self._c._pages("/v1/runs", {}):
            yield Run.from_dict(item)

    def get(self, id: Any) -> RunDetail:
        return RunDetail.from_dict(self._c._json("GET", f"/v1/runs/{cfg.ident(id)}"))

    def resume(self, id: Any) -> Run:
        return Run.from_dict(self._c._json("POST", f"/v1/runs/{cfg.ident(id)}/resume"))

    def approve(self, id: Any, stage: str, reason: Optional[str] = None, by: Optional[str] = None) -> Run:
        """Approves a stage waiting for a person (status `awaiting_approval`); the run goes on in the server."""
        body = {k: v for k, v in (("reason", reason), ("by", by)) if v is not None}
        return Run.from_dict(self._c._json("POST", f"/v1/runs/{cfg.ident(id)}/stages/{cfg.ident(stage)}/approve", json=body))

    def reject(self, id: Any, stage: str, reason: str, by: Optional[str] = None) -> Run:
        """Rejects a stage waiting for a person: the run fails there."""
        body = {k: v for k, v in (("reason", reason), ("by", by)) if v is not None}
        return Run.from_dict(self._c._json("POST", f"/v1/runs/{cfg.ident(id)}/stages/{cfg.ident(stage)}/reject", json=body))

    def wait(self, id: Any, timeout: Optional[float] = None, poll: float = 0.5) -> RunDetail:
        """Polls until the run is no longer `running`; TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            detail = self.get(id)
            if detail.run.status != "running":
                return detail
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {detail.run.id} still running after {timeout}s")
            time.sleep(poll)

    def log(self, id: Any, stage: str, branch: Optional[str] = None, tail_bytes: Optional[int] = None) -> str:
        """A stage's log; with `tail_bytes`, only its end (from a line's start)."""
        params = {k: v for k, v in (("branch", branch), ("tail_bytes", tail_bytes)) if v}
        return self._c._send("GET", f"/v1/runs/{cfg.ident(id)}/logs/{stage}", params=params or None).text

    def audit(self, id: Any) -> RunAudit:
        """Where the run's time and bytes went, per stage, with advice (`cairn audit --json`)."""
        return RunAudit.from_dict(self._c._json("GET", f"/v1/runs/{cfg.ident(id)}/audit"))


class Artifacts:
    def __init__(self, client: Client) -> None:
        self._c = client

    def download(self, id: Any, dest: Any = None) -> Any:
        """The artifact's bytes; with `dest` (a path or file object) streams there and answers the size."""
        resp = self._c._send("GET", f"/v1/artifacts/{cfg.ident(id)}", stream=True)
        try:
            if dest is None:
                return b"".join(resp.iter_bytes())
            return _save(resp, resp.iter_bytes(), dest, str(id))
        except httpx.TransportError as e:
            raise errors.from_transport(e, self._c.where) from None
        finally:
            resp.close()


class DeadLetters:
    def __init__(self, client: Client) -> None:
        self._c = client

    def list(self) -> List[DeadLetter]:
        return [DeadLetter.from_dict(d) for d in self._c._json("GET", "/v1/dlq")]

    def get(self, id: str) -> DeadLetter:
        return DeadLetter.from_dict(self._c._json("GET", f"/v1/dlq/{id}"))

    def retry(self, id: str) -> DeadLetter:
        return DeadLetter.from_dict(self._c._json("POST", f"/v1/dlq/{id}/retry"))


class SessionExecStream(ExecStream):
    """A command running in a session: iterate for `Output` pieces as they
    happen; afterwards `.result` is the SessionExecResult. Leaving the loop
    early does not stop the command: it runs to its end and the session's
    log records its result."""

    _result_type = SessionExecResult

    def started(self) -> int:
        raise TypeError("a session's exec does not expose its process: it is the session's to record, "
                        "not to signal or feed; iterate the stream for its output")


def _entry_body(kind: str, content: Optional[str], role: Optional[str], tool: Optional[str], arguments: Any,
                result: Optional[str], exit_status: Optional[int], tokens_in: Optional[int],
                tokens_out: Optional[int]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"kind": kind}
    for k, v in (("content", content), ("role", role), ("tool", tool), ("arguments", arguments),
                 ("result", result), ("exit_status", exit_status), ("tokens_in", tokens_in),
                 ("tokens_out", tokens_out)):
        if v is not None:
            body[k] = v
    return body


def _log_params(from_: Optional[int], limit: Optional[int], tail: Optional[int],
                before: Optional[int] = None) -> Dict[str, Any]:
    if tail is not None and (from_ is not None or limit is not None or before is not None):
        raise ValueError("give tail alone, from_ and limit, or before and limit")
    if before is not None and from_ is not None:
        raise ValueError("give before and limit, or from_ and limit")
    if tail is not None:
        return {"tail": tail}
    if before is not None:
        return {"before": before, "limit": limit or 1000}
    return {"from": from_ or 1, "limit": limit or 1000}


class Sessions:
    """Agent sessions (docs/sessions.md). `id` is an id, a unique id prefix,
    a name, or a Session."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def _path(self, id: Any, tail: str = "") -> str:
        return f"/v1/sessions/{cfg.ident(id)}{tail}"

    def create(self, name: Optional[str] = None, image: Optional[str] = None, driver: Optional[str] = None,
               idle_timeout_ms: Optional[int] = None, *, idempotency_key: Optional[str] = None) -> Session:
        """Creates a session and its sandbox (image default busybox)."""
        body = {k: v for k, v in (("name", name), ("image", image), ("driver", driver),
                                  ("idle_timeout_ms", idle_timeout_ms)) if v is not None}
        return Session.from_dict(self._c._json("POST", "/v1/sessions", json=body,
                                               headers=cfg.key_header(idempotency_key)))

    def list(self, state: Optional[str] = None, image: Optional[str] = None) -> Iterator[Session]:
        """Every session (all pages), oldest first."""
        for item in self._c._pages("/v1/sessions", {"state": state, "image": image}):
            yield Session.from_dict(item)

    def get(self, id: Any) -> Session:
        return Session.from_dict(self._c._json("GET", self._path(id)))

    def delete(self, id: Any, purge: bool = False) -> None:
        """Closes the session (its sandbox goes, its log stays); `purge` deletes the log too."""
        self._c._send("DELETE", self._path(id), params={"purge": "true"} if purge else None)

    def append(self, id: Any, kind: str, content: Optional[str] = None, *, role: Optional[str] = None,
               tool: Optional[str] = None, arguments: Any = None, result: Optional[str] = None,
               exit_status: Optional[int] = None, tokens_in: Optional[int] = None,
               tokens_out: Optional[int] = None) -> LogEntry:
        """Appends one entry; answers it with its seq and hash."""
        body = _entry_body(kind, content, role, tool, arguments, result, exit_status, tokens_in, tokens_out)
        return LogEntry.from_dict(self._c._json("POST", self._path(id, "/entries"), json=body))

    def log(self, id: Any, *, from_: Optional[int] = None, limit: Optional[int] = None,
            tail: Optional[int] = None, before: Optional[int] = None) -> List[LogEntry]:
        """The live log: the last `tail` entries; `limit` entries from `from_`;
        the last `limit` (default 1000) before seq `before`; or, with none of
        limit, tail and before, every entry from `from_` (default 1)."""
        params = _log_params(from_, limit, tail, before)
        out: List[LogEntry] = []
        while True:
            page = self._c._json("GET", self._path(id, "/log"), params=params)
            out.extend(LogEntry.from_dict(e) for e in page.get("entries", []))
            if tail is not None or limit is not None or before is not None or not page.get("next"):
                return out
            params["from"] = page["next"]

    def exec(self, id: Any, argv: Any, *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
             timeout: Optional[float] = None) -> SessionExecResult:
        """Runs a command (a list, or a string run by `sh -c`) in the session,
        resuming it first when suspended; the log records the call (with its
        env, cwd and timeout) and its result. A timeout exits 124."""
        body = cfg.exec_body(argv, env, cwd, timeout, None)
        return SessionExecResult.from_dict(self._c._json("POST", self._path(id, "/exec"), json=body))

    def exec_stream(self, id: Any, argv: Any, *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                    timeout: Optional[float] = None) -> SessionExecStream:
        body = cfg.exec_body(argv, env, cwd, timeout, None)
        return SessionExecStream(self._c, self._c._send("POST", self._path(id, "/exec/stream"), json=body,
                                                        stream=True))

    def write_file(self, id: Any, path: str, data: Any, mode: int = 0o644) -> FileStat:
        """Writes a file into the session's sandbox (resuming it first); the
        log records a `write_file` call with the size and BLAKE3 hash."""
        raw = cfg.text_bytes(data)
        content = raw if raw is not None else cfg.file_chunks(data)
        return FileStat.from_dict(self._c._json(
            "PUT", self._path(id, "/files"), params={"path": path, "mode": format(mode, "o")},
            content=content, headers={"Content-Type": "application/octet-stream"}))

    def read_file(self, id: Any, path: str) -> bytes:
        """Reads a file of the session's sandbox (resuming it first; not logged)."""
        resp = self._c._send("GET", self._path(id, "/files"), params={"path": path}, stream=True)
        try:
            return b"".join(resp.iter_bytes())
        except httpx.TransportError as e:
            raise errors.CairnError(f"reading {path} was cut short: {e}", code="transport") from None
        finally:
            resp.close()

    def export(self, id: Any, dest: Any) -> int:
        """Writes the session as one bundle file (its log chain and the
        snapshots it names) to `dest`, a path or a binary file object;
        answers the bytes written. An active session is snapshotted first."""
        resp = self._c._send("GET", self._path(id, "/export"), stream=True)
        try:
            return _save(resp, resp.iter_bytes(), dest, "the bundle")
        except httpx.TransportError as e:
            raise errors.CairnError(f"exporting {cfg.ident(id)} was cut short: {e}", code="transport") from None
        finally:
            resp.close()

    def import_(self, bundle: Any, name: Optional[str] = None) -> Session:
        """Imports a bundle (a path or a binary file object) as a new
        suspended session; `name` defaults to the exported one."""
        params = {"name": name} if name is not None else None
        if not hasattr(bundle, "read"):
            with open(os.fspath(bundle), "rb") as f:
                return self.import_(f, name)
        out = self._c._json("POST", "/v1/sessions/import", params=params, content=cfg.file_chunks(bundle),
                            headers={"Content-Type": "application/octet-stream"})
        return Session.from_dict(out["session"])

    def recover(self, id: Any, replay: bool = False) -> RecoverResult:
        """Restores a dead sandbox from the newest snapshot; with `replay`,
        re-runs the lost exec calls, stopping at the first that diverges."""
        return RecoverResult.from_dict(self._c._json("POST", self._path(id, "/recover"), json={"replay": replay}))

    def suspend(self, id: Any) -> Session:
        """Snapshots the sandbox, records the snapshot, removes the sandbox."""
        return Session.from_dict(self._c._json("POST", self._path(id, "/suspend")))

    def resume(self, id: Any) -> Session:
        return Session.from_dict(self._c._json("POST", self._path(id, "/resume")))

    def fork(self, id: Any, at: int, reason: str, name: Optional[str] = None, *,
             idempotency_key: Optional[str] = None) -> Session:
        """A new session whose log is this one's up to entry `at`, on the
        machine as the newest snapshot at or before it left it."""
        body: Dict[str, Any] = {"at": int(at), "reason": reason}
        if name is not None:
            body["name"] = name
        return Session.from_dict(self._c._json("POST", self._path(id, "/fork"), json=body,
                                               headers=cfg.key_header(idempotency_key)))

    def rewind(self, id: Any, to: int) -> Rewind:
        """Moves the live log back to entry `to` (later entries are kept, abandoned)."""
        return Rewind.from_dict(self._c._json("POST", self._path(id, "/rewind"), json={"to": int(to)}))

    def verify(self, id: Any) -> Verification:
        return Verification.from_dict(self._c._json("GET", self._path(id, "/verify")))
