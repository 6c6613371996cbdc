"""The asynchronous client: the same resources as `Client`, awaited."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

import httpx

from . import _config as cfg
from . import errors
from ._sse import aevents
from .client import _STARTED, _entry_body, _log_params
from .models import (DeadLetter, Event, ExecResult, FileStat, ForkResult, Health, Image, LogEntry, Output,
                     RecoverResult, Rewind, Run, RunAudit, RunDetail, Sandbox, Session, SessionExecResult, Snapshot,
                     SnapshotDetail, SnapshotDiff, Verification)


@dataclass
class AsyncSandbox(Sandbox):
    """A sandbox bound to an AsyncClient: its methods are awaited, and
    `async with` removes it on exit."""

    async def exec(self, argv: Any, **kw: Any) -> ExecResult:  # type: ignore[override]
        return await self._api().exec(self.id, argv, **kw)

    async def exec_stream(self, argv: Any, **kw: Any) -> "AsyncExecStream":  # type: ignore[override]
        return await self._api().exec_stream(self.id, argv, **kw)

    async def write_file(self, path: str, data: Any, mode: int = 0o644) -> FileStat:  # type: ignore[override]
        return await self._api().write_file(self.id, path, data, mode=mode)

    async def read_file(self, path: str) -> bytes:  # type: ignore[override]
        return await self._api().read_file(self.id, path)

    async def download(self, path: str, dest: Any) -> int:  # type: ignore[override]
        return await self._api().download(self.id, path, dest)

    async def stat(self, path: str) -> FileStat:  # type: ignore[override]
        return await self._api().stat(self.id, path)

    async def snapshot(self, label: Optional[str] = None) -> Snapshot:  # type: ignore[override]
        return await self._api().snapshot(self.id, label)

    async def fork(self, count: int = 1, *, idempotency_key: Optional[str] = None) -> ForkResult:  # type: ignore[override]
        return await self._api().fork(self.id, count, idempotency_key=idempotency_key)

    async def reset(self, snapshot: Any) -> "AsyncSandbox":  # type: ignore[override]
        return await self._api().reset(self.id, snapshot)

    async def signal(self, pid: int, sig: Any) -> None:  # type: ignore[override]
        await self._api().signal(self.id, pid, sig)

    async def write_stdin(self, pid: int, data: Any, close: bool = False) -> None:  # type: ignore[override]
        await self._api().write_stdin(self.id, pid, data, close=close)

    async def refresh(self) -> "AsyncSandbox":  # type: ignore[override]
        return await self._api().get(self.id)

    async def remove(self, force: bool = True) -> None:  # type: ignore[override]
        await self._api().remove(self.id, force=force)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.remove(force=True)
        except errors.NotFound:
            pass


class AsyncClient:
    """The asynchronous twin of `Client`; the same connection rules."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, *, socket: Optional[str] = None,
                 home: Optional[str] = None, timeout: Any = None,
                 transport: Optional[httpx.AsyncBaseTransport] = None) -> None:
        self._target = cfg.resolve(url, token, socket, home)
        if transport is None and self._target.socket:
            transport = httpx.AsyncHTTPTransport(uds=self._target.socket)
        self._http = httpx.AsyncClient(transport=transport, **cfg.client_kwargs(self._target, timeout))
        self.sandboxes = AsyncSandboxes(self)
        self.snapshots = AsyncSnapshots(self)
        self.images = AsyncImages(self)
        self.runs = AsyncRuns(self)
        self.artifacts = AsyncArtifacts(self)
        self.dlq = AsyncDeadLetters(self)
        self.sessions = AsyncSessions(self)

    @property
    def where(self) -> str:
        return self._target.where

    async def _send(self, method: str, path: str, *, stream: bool = False, **kw: Any) -> httpx.Response:
        try:
            req = self._http.build_request(method, path, **kw)
            resp = await self._http.send(req, stream=stream)
        except httpx.TransportError as e:
            raise errors.from_transport(e, self.where) from None
        if resp.status_code >= 400:
            try:
                body = await resp.aread()
            except httpx.TransportError:
                body = b""
            finally:
                await resp.aclose()
            raise errors.from_response(resp.status_code, body)
        return resp

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = await self._send(method, path, **kw)
        return resp.json() if resp.content else None

    async def _pages(self, path: str, params: Dict[str, Any]) -> AsyncIterator[Dict[str, Any]]:
        params = {k: v for k, v in params.items() if v is not None}
        while True:
            page = await self._json("GET", path, params=params)
            for item in page.get("items", []):
                yield item
            nxt = page.get("next")
            if not nxt:
                return
            params["after"] = nxt

    async def _sse(self, method: str, path: str, **kw: Any) -> AsyncIterator[Any]:
        resp = await self._send(method, path, stream=True, **kw)
        try:
            async for ev in aevents(resp.aiter_lines()):
                yield ev
        except httpx.TransportError as e:
            raise errors.from_transport(e, self.where) from None
        finally:
            await resp.aclose()

    async def request(self, method: str, path: str, **kw: Any) -> Any:
        """Calls any route and answers its JSON (None without a body)."""
        return await self._json(method, path, **kw)

    async def health(self) -> Health:
        return Health.from_dict(await self._json("GET", "/healthz"))

    async def metrics(self) -> str:
        return (await self._send("GET", "/metrics")).text

    async def openapi(self) -> Dict[str, Any]:
        return await self._json("GET", "/v1/openapi.json")

    async def events(self) -> AsyncIterator[Event]:
        async for kind, data in self._sse("GET", "/v1/events"):
            if isinstance(data, dict) and "id" in data:
                yield Event.from_dict(data)
            else:
                yield Event(kind=kind, detail=str(data))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class AsyncExecStream:
    """`async for` over a running command's `Output`; then `.result`.
    `await started()` answers the pid once the process runs."""

    _result_type: Any = ExecResult

    def __init__(self, client: AsyncClient, resp: httpx.Response) -> None:
        self._client, self._resp = client, resp
        self._events = aevents(resp.aiter_lines())
        self._early: List[Output] = []
        self.pid: Optional[int] = None
        self.result: Optional[ExecResult] = None

    async def _next(self) -> Optional[Output]:
        try:
            async for kind, data in self._events:
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

    async def started(self) -> int:
        while self.pid is None and self.result is None:
            out = await self._next()
            if out is None:
                break
            if out is not _STARTED:
                self._early.append(out)
        assert self.pid is not None
        return self.pid

    async def __aiter__(self) -> AsyncIterator[Output]:
        try:
            while self._early:
                yield self._early.pop(0)
            while self.result is None:
                out = await self._next()
                if out is None:
                    return
                if out is not _STARTED:
                    yield out
        finally:
            # Leaving the loop early ends the stream, and so the process.
            await self._resp.aclose()

    async def wait(self) -> ExecResult:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def aclose(self) -> None:
        await self._resp.aclose()

    async def __aenter__(self) -> "AsyncExecStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


async def _achunks(f: Any) -> AsyncIterator[bytes]:
    for b in cfg.file_chunks(f):
        yield b


async def _asave(resp: httpx.Response, dest: Any) -> int:
    n = 0
    if hasattr(dest, "write"):
        async for b in resp.aiter_bytes():
            dest.write(b)
            n += len(b)
        return n
    tmp = f"{os.fspath(dest)}.part"
    with open(tmp, "wb") as f:
        async for b in resp.aiter_bytes():
            f.write(b)
            n += len(b)
    mode = resp.headers.get("x-cairn-mode")
    if mode:
        os.chmod(tmp, int(mode, 8))
    os.replace(tmp, dest)
    return n


class AsyncSandboxes:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    def _bind(self, data: Dict[str, Any]) -> AsyncSandbox:
        return AsyncSandbox.from_dict(data, _ops=self)

    async def create(self, image: Optional[str] = None, snapshot: Any = None, driver: Optional[str] = None,
                     name: Optional[str] = None, memory: Any = None, cpus: Any = None, pids: Optional[int] = None,
                     services: Optional[List[str]] = None, idempotency_key: Optional[str] = None,
                     wait: Optional[float] = None, priority: Optional[int] = None) -> AsyncSandbox:
        """As `Sandboxes.create`: past the server's capacity it waits at most
        `wait` seconds, then raises `NoCapacity`."""
        body = cfg.create_body(image, snapshot, driver, name, memory, cpus, pids, services)
        return self._bind(await self._c._json("POST", "/v1/sandboxes", json=body,
                                              headers=cfg.admission_headers(idempotency_key, wait, priority)))

    async def list(self, state: Optional[str] = None, image: Optional[str] = None) -> AsyncIterator[AsyncSandbox]:
        async for item in self._c._pages("/v1/sandboxes", {"state": state, "image": image}):
            yield self._bind(item)

    async def get(self, id: Any) -> AsyncSandbox:
        return self._bind(await self._c._json("GET", f"/v1/sandboxes/{cfg.ident(id)}"))

    async def remove(self, id: Any, force: bool = False) -> None:
        await self._c._send("DELETE", f"/v1/sandboxes/{cfg.ident(id)}", params={"force": "true"} if force else None)

    async def exec(self, id: str, argv: Any, *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                   timeout: Optional[float] = None, stdin: Optional[str] = None) -> ExecResult:
        body = cfg.exec_body(argv, env, cwd, timeout, stdin)
        return ExecResult.from_dict(await self._c._json("POST", f"/v1/sandboxes/{id}/exec", json=body))

    async def exec_stream(self, id: str, argv: Any, *, env: Optional[Dict[str, str]] = None,
                          cwd: Optional[str] = None, timeout: Optional[float] = None,
                          stdin: Optional[str] = None) -> AsyncExecStream:
        body = cfg.exec_body(argv, env, cwd, timeout, stdin)
        resp = await self._c._send("POST", f"/v1/sandboxes/{id}/exec/stream", json=body, stream=True)
        return AsyncExecStream(self._c, resp)

    async def write_file(self, id: str, path: str, data: Any, mode: int = 0o644) -> FileStat:
        raw = cfg.text_bytes(data)
        content = raw if raw is not None else _achunks(data)
        return FileStat.from_dict(await self._c._json(
            "PUT", f"/v1/sandboxes/{id}/files", params={"path": path, "mode": format(mode, "o")},
            content=content, headers={"Content-Type": "application/octet-stream"}))

    async def read_file(self, id: str, path: str) -> bytes:
        resp = await self._c._send("GET", f"/v1/sandboxes/{id}/files", params={"path": path}, stream=True)
        try:
            return b"".join([b async for b in resp.aiter_bytes()])
        except httpx.TransportError as e:
            raise errors.CairnError(f"reading {path} was cut short: {e}", code="transport") from None
        finally:
            await resp.aclose()

    async def download(self, id: str, path: str, dest: Any) -> int:
        resp = await self._c._send("GET", f"/v1/sandboxes/{id}/files", params={"path": path}, stream=True)
        try:
            return await _asave(resp, dest)
        except httpx.TransportError as e:
            raise errors.CairnError(f"downloading {path} was cut short: {e}", code="transport") from None
        finally:
            await resp.aclose()

    async def stat(self, id: str, path: str) -> FileStat:
        return FileStat.from_dict(await self._c._json("GET", f"/v1/sandboxes/{id}/files/stat",
                                                      params={"path": path}))

    async def snapshot(self, id: str, label: Optional[str] = None) -> Snapshot:
        body = {"label": label} if label is not None else {}
        return Snapshot.from_dict(await self._c._json("POST", f"/v1/sandboxes/{id}/snapshots", json=body))

    async def fork(self, id: str, count: int = 1, *, idempotency_key: Optional[str] = None) -> ForkResult:
        data = await self._c._json("POST", f"/v1/sandboxes/{id}/fork", json={"count": count},
                                   headers=cfg.key_header(idempotency_key))
        return _async_fork(data, self)

    async def reset(self, id: str, snapshot: Any) -> AsyncSandbox:
        return self._bind(await self._c._json("POST", f"/v1/sandboxes/{id}/reset",
                                              json={"snapshot": cfg.ident(snapshot)}))

    async def signal(self, id: str, pid: int, sig: Any) -> None:
        await self._c._send("POST", f"/v1/sandboxes/{id}/processes/{int(pid)}/signal", json={"signal": sig})

    async def write_stdin(self, id: str, pid: int, data: Any, close: bool = False) -> None:
        body: Dict[str, Any] = {"close": close}
        if isinstance(data, str):
            body["data"] = data
        elif data is not None:
            body["data_base64"] = base64.b64encode(bytes(data)).decode()
        await self._c._send("POST", f"/v1/sandboxes/{id}/processes/{int(pid)}/stdin", json=body)


def _async_fork(data: Dict[str, Any], sandboxes: AsyncSandboxes) -> ForkResult:
    return ForkResult(snapshot=Snapshot.from_dict(data["snapshot"]),
                      sandboxes=[sandboxes._bind(s) for s in data.get("sandboxes", [])])


class AsyncSnapshots:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def list(self) -> AsyncIterator[Snapshot]:
        async for item in self._c._pages("/v1/snapshots", {}):
            yield Snapshot.from_dict(item)

    async def get(self, id: Any) -> SnapshotDetail:
        return SnapshotDetail.from_dict(await self._c._json("GET", f"/v1/snapshots/{cfg.ident(id)}"))

    async def remove(self, id: Any) -> None:
        await self._c._send("DELETE", f"/v1/snapshots/{cfg.ident(id)}")

    async def verify(self, id: Any, *, repair: bool = False) -> Dict[str, Any]:
        """`cairn verify` of one snapshot: the report (`ok`, `damaged`, ...)."""
        return await self._c._json("POST", f"/v1/snapshots/{cfg.ident(id)}/verify", json={"repair": repair})

    async def diff(self, a: Any, b: Any, *, text_max: Optional[int] = None,
                   max_changes: Optional[int] = None) -> SnapshotDiff:
        """How `b` differs from `a` (see `Snapshots.diff`)."""
        return SnapshotDiff.from_dict(await self._c._json("GET", "/v1/diff",
                                                          params=cfg.diff_params(a, b, text_max, max_changes)))

    async def fork(self, id: Any, count: int = 1, *, driver: Optional[str] = None, memory: Any = None,
                   cpus: Any = None, pids: Optional[int] = None, idempotency_key: Optional[str] = None) -> ForkResult:
        body: Dict[str, Any] = {"count": count}
        if driver:
            body["driver"] = driver
        limits = cfg.limits_body(memory, cpus, pids)
        if limits:
            body["limits"] = limits
        data = await self._c._json("POST", f"/v1/snapshots/{cfg.ident(id)}/fork", json=body,
                                   headers=cfg.key_header(idempotency_key))
        return _async_fork(data, self._c.sandboxes)

    async def restore(self, id: Any, *, name: Optional[str] = None, driver: Optional[str] = None,
                      memory: Any = None, cpus: Any = None, pids: Optional[int] = None) -> AsyncSandbox:
        body: Dict[str, Any] = {k: v for k, v in (("name", name), ("driver", driver)) if v is not None}
        limits = cfg.limits_body(memory, cpus, pids)
        if limits:
            body["limits"] = limits
        return self._c.sandboxes._bind(
            await self._c._json("POST", f"/v1/snapshots/{cfg.ident(id)}/restore", json=body))


class AsyncImages:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def list(self) -> List[Image]:
        return [Image.from_dict(i) for i in await self._c._json("GET", "/v1/images")]

    async def build(self, name: str, kind: str = "busybox", *, packages: Optional[List[str]] = None,
                    suite: Optional[str] = None, on_step: Optional[Callable[[str], Any]] = None) -> Image:
        body: Dict[str, Any] = {"name": name, "kind": kind}
        if packages:
            body["packages"] = list(packages)
        if suite:
            body["suite"] = suite
        async for ev, data in self._c._sse("POST", "/v1/images", json=body):
            if ev == "step" and on_step is not None:
                r = on_step(data.get("message", "") if isinstance(data, dict) else str(data))
                if asyncio.iscoroutine(r):
                    await r
            elif ev == "image":
                return Image.from_dict(data)
            elif ev == "error":
                raise errors.from_event(data)
        raise errors.CairnError("the image build stream ended without an image", code="stream_ended")

    async def import_tar(self, name: str, tar: Any) -> Image:
        if hasattr(tar, "read"):
            return Image.from_dict(await self._c._json("POST", "/v1/images/import", params={"name": name},
                                                       content=_achunks(tar),
                                                       headers={"Content-Type": "application/x-tar"}))
        with open(tar, "rb") as f:
            return await self.import_tar(name, f)

    async def remove(self, name: str) -> None:
        await self._c._send("DELETE", f"/v1/images/{name}")


class AsyncRuns:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def start(self, pipeline: str, params: Optional[Dict[str, str]] = None, *, file: Optional[str] = None,
                    queue: bool = False, idempotency_key: Optional[str] = None) -> Run:
        body: Dict[str, Any] = {"pipeline": pipeline}
        if params:
            body["params"] = {k: str(v) for k, v in params.items()}
        if file:
            body["file"] = file
        if queue:
            body["queue"] = True
        return Run.from_dict(await self._c._json("POST", "/v1/runs", json=body,
                                                 headers=cfg.key_header(idempotency_key)))

    async def list(self) -> AsyncIterator[Run]:
        async for item in self._c._pages("/v1/runs", {}):
            yield Run.from_dict(item)

    async def get(self, id: Any) -> RunDetail:
        return RunDetail.from_dict(await self._c._json("GET", f"/v1/runs/{cfg.ident(id)}"))

    async def resume(self, id: Any) -> Run:
        return Run.from_dict(await self._c._json("POST", f"/v1/runs/{cfg.ident(id)}/resume"))

    async def approve(self, id: Any, stage: str, reason: Optional[str] = None, by: Optional[str] = None) -> Run:
        """Approves a stage waiting for a person (status `awaiting_approval`); the run goes on in the server."""
        body = {k: v for k, v in (("reason", reason), ("by", by)) if v is not None}
        return Run.from_dict(
            await self._c._json("POST", f"/v1/runs/{cfg.ident(id)}/stages/{cfg.ident(stage)}/approve", json=body))

    async def reject(self, id: Any, stage: str, reason: str, by: Optional[str] = None) -> Run:
        """Rejects a stage waiting for a person: the run fails there."""
        body = {k: v for k, v in (("reason", reason), ("by", by)) if v is not None}
        return Run.from_dict(
            await self._c._json("POST", f"/v1/runs/{cfg.ident(id)}/stages/{cfg.ident(stage)}/reject", json=body))

    async def wait(self, id: Any, timeout: Optional[float] = None, poll: float = 0.5) -> RunDetail:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            detail = await self.get(id)
            if detail.run.status != "running":
                return detail
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {detail.run.id} still running after {timeout}s")
            await asyncio.sleep(poll)

    async def log(self, id: Any, stage: str, branch: Optional[str] = None, tail_bytes: Optional[int] = None) -> str:
        """A stage's log; with `tail_bytes`, only its end (from a line's start)."""
        params = {k: v for k, v in (("branch", branch), ("tail_bytes", tail_bytes)) if v}
        return (await self._c._send("GET", f"/v1/runs/{cfg.ident(id)}/logs/{stage}", params=params or None)).text

    async def audit(self, id: Any) -> RunAudit:
        """Where the run's time and bytes went, per stage, with advice (`cairn audit --json`)."""
        return RunAudit.from_dict(await self._c._json("GET", f"/v1/runs/{cfg.ident(id)}/audit"))


class AsyncArtifacts:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def download(self, id: Any, dest: Any = None) -> Any:
        resp = await self._c._send("GET", f"/v1/artifacts/{cfg.ident(id)}", stream=True)
        try:
            if dest is None:
                return b"".join([b async for b in resp.aiter_bytes()])
            return await _asave(resp, dest)
        except httpx.TransportError as e:
            raise errors.from_transport(e, self._c.where) from None
        finally:
            await resp.aclose()


class AsyncDeadLetters:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def list(self) -> List[DeadLetter]:
        return [DeadLetter.from_dict(d) for d in await self._c._json("GET", "/v1/dlq")]

    async def get(self, id: str) -> DeadLetter:
        return DeadLetter.from_dict(await self._c._json("GET", f"/v1/dlq/{id}"))

    async def retry(self, id: str) -> DeadLetter:
        return DeadLetter.from_dict(await self._c._json("POST", f"/v1/dlq/{id}/retry"))


class AsyncSessionExecStream(AsyncExecStream):
    """`async for` over a command running in a session; then `.result`, a
    SessionExecResult. Leaving early does not stop the command: the log
    records its result."""

    _result_type = SessionExecResult

    async def started(self) -> int:
        raise TypeError("a session's exec does not expose its process: it is the session's to record, "
                        "not to signal or feed; iterate the stream for its output")


class AsyncSessions:
    """The asynchronous twin of `Client.sessions`."""

    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    def _path(self, id: Any, tail: str = "") -> str:
        return f"/v1/sessions/{cfg.ident(id)}{tail}"

    async def create(self, name: Optional[str] = None, image: Optional[str] = None, driver: Optional[str] = None,
                     idle_timeout_ms: Optional[int] = None, *, idempotency_key: Optional[str] = None) -> Session:
        body = {k: v for k, v in (("name", name), ("image", image), ("driver", driver),
                                  ("idle_timeout_ms", idle_timeout_ms)) if v is not None}
        return Session.from_dict(await self._c._json("POST", "/v1/sessions", json=body,
                                                     headers=cfg.key_header(idempotency_key)))

    async def list(self, state: Optional[str] = None, image: Optional[str] = None) -> AsyncIterator[Session]:
        async for item in self._c._pages("/v1/sessions", {"state": state, "image": image}):
            yield Session.from_dict(item)

    async def get(self, id: Any) -> Session:
        return Session.from_dict(await self._c._json("GET", self._path(id)))

    async def delete(self, id: Any, purge: bool = False) -> None:
        await self._c._send("DELETE", self._path(id), params={"purge": "true"} if purge else None)

    async def append(self, id: Any, kind: str, content: Optional[str] = None, *, role: Optional[str] = None,
                     tool: Optional[str] = None, arguments: Any = None, result: Optional[str] = None,
                     exit_status: Optional[int] = None, tokens_in: Optional[int] = None,
                     tokens_out: Optional[int] = None) -> LogEntry:
        body = _entry_body(kind, content, role, tool, arguments, result, exit_status, tokens_in, tokens_out)
        return LogEntry.from_dict(await self._c._json("POST", self._path(id, "/entries"), json=body))

    async def log(self, id: Any, *, from_: Optional[int] = None, limit: Optional[int] = None,
                  tail: Optional[int] = None, before: Optional[int] = None) -> List[LogEntry]:
        params = _log_params(from_, limit, tail, before)
        out: List[LogEntry] = []
        while True:
            page = await self._c._json("GET", self._path(id, "/log"), params=params)
            out.extend(LogEntry.from_dict(e) for e in page.get("entries", []))
            if tail is not None or limit is not None or before is not None or not page.get("next"):
                return out
            params["from"] = page["next"]

    async def exec(self, id: Any, argv: Any, *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                   timeout: Optional[float] = None) -> SessionExecResult:
        body = cfg.exec_body(argv, env, cwd, timeout, None)
        return SessionExecResult.from_dict(await self._c._json("POST", self._path(id, "/exec"), json=body))

    async def exec_stream(self, id: Any, argv: Any, *, env: Optional[Dict[str, str]] = None,
                          cwd: Optional[str] = None, timeout: Optional[float] = None) -> AsyncSessionExecStream:
        body = cfg.exec_body(argv, env, cwd, timeout, None)
        resp = await self._c._send("POST", self._path(id, "/exec/stream"), json=body, stream=True)
        return AsyncSessionExecStream(self._c, resp)

    async def write_file(self, id: Any, path: str, data: Any, mode: int = 0o644) -> FileStat:
        raw = cfg.text_bytes(data)
        content = raw if raw is not None else _achunks(data)
        return FileStat.from_dict(await self._c._json(
            "PUT", self._path(id, "/files"), params={"path": path, "mode": format(mode, "o")},
            content=content, headers={"Content-Type": "application/octet-stream"}))

    async def read_file(self, id: Any, path: str) -> bytes:
        resp = await self._c._send("GET", self._path(id, "/files"), params={"path": path}, stream=True)
        try:
            return b"".join([b async for b in resp.aiter_bytes()])
        except httpx.TransportError as e:
            raise errors.CairnError(f"reading {path} was cut short: {e}", code="transport") from None
        finally:
            await resp.aclose()

    async def export(self, id: Any, dest: Any) -> int:
        resp = await self._c._send("GET", self._path(id, "/export"), stream=True)
        try:
            return await _asave(resp, dest)
        except httpx.TransportError as e:
            raise errors.CairnError(f"exporting {cfg.ident(id)} was cut short: {e}", code="transport") from None
        finally:
            await resp.aclose()

    async def import_(self, bundle: Any, name: Optional[str] = None) -> Session:
        params = {"name": name} if name is not None else None
        if not hasattr(bundle, "read"):
            with open(os.fspath(bundle), "rb") as f:
                return await self.import_(f, name)
        out = await self._c._json("POST", "/v1/sessions/import", params=params, content=_achunks(bundle),
                                  headers={"Content-Type": "application/octet-stream"})
        return Session.from_dict(out["session"])

    async def recover(self, id: Any, replay: bool = False) -> RecoverResult:
        return RecoverResult.from_dict(await self._c._json("POST", self._path(id, "/recover"),
                                                           json={"replay": replay}))

    async def suspend(self, id: Any) -> Session:
        return Session.from_dict(await self._c._json("POST", self._path(id, "/suspend")))

    async def resume(self, id: Any) -> Session:
        return Session.from_dict(await self._c._json("POST", self._path(id, "/resume")))

    async def fork(self, id: Any, at: int, reason: str, name: Optional[str] = None, *,
                   idempotency_key: Optional[str] = None) -> Session:
        body: Dict[str, Any] = {"at": int(at), "reason": reason}
        if name is not None:
            body["name"] = name
        return Session.from_dict(await self._c._json("POST", self._path(id, "/fork"), json=body,
                                                     headers=cfg.key_header(idempotency_key)))

    async def rewind(self, id: Any, to: int) -> Rewind:
        return Rewind.from_dict(await self._c._json("POST", self._path(id, "/rewind"), json={"to": int(to)}))

    async def verify(self, id: Any) -> Verification:
        return Verification.from_dict(await self._c._json("GET", self._path(id, "/verify")))
