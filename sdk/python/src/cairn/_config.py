"""Where the server is: the Unix socket by default, CAIRN_URL + CAIRN_TOKEN
when set; constructor arguments override the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import httpx

DEFAULT_TIMEOUT = httpx.Timeout(30.0, read=None)
CHUNK = 1 << 20


@dataclass
class Target:
    base_url: str
    socket: Optional[str]
    token: Optional[str]

    @property
    def where(self) -> str:
        return f"unix socket {self.socket}" if self.socket else self.base_url

    def headers(self) -> Dict[str, str]:
        h = {"User-Agent": "cairn-sdk-python/0.1.0"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h


def resolve(url: Optional[str] = None, token: Optional[str] = None, socket: Optional[str] = None,
            home: Optional[Union[str, "os.PathLike[str]"]] = None) -> Target:
    if socket is None and url is None and home is None:
        url = os.environ.get("CAIRN_URL") or None
    if url is not None and socket is None:
        if token is None:
            token = os.environ.get("CAIRN_TOKEN") or None
        return Target(base_url=url.rstrip("/"), socket=None, token=token)
    if socket is None:
        root = home or os.environ.get("CAIRN_HOME") or os.path.join(
            os.path.expanduser("~"), ".local", "share", "cairn")
        socket = os.path.join(os.fspath(root), "cairn.sock")
    return Target(base_url="http://cairn", socket=os.fspath(socket), token=token)


def client_kwargs(t: Target, timeout: Any) -> Dict[str, Any]:
    return {"base_url": t.base_url, "headers": t.headers(),
            "timeout": DEFAULT_TIMEOUT if timeout is None else timeout}


def exec_body(argv: Any, env: Optional[Dict[str, str]], cwd: Optional[str], timeout: Optional[float],
              stdin: Optional[str]) -> Dict[str, Any]:
    if isinstance(argv, str):
        argv = ["sh", "-c", argv]
    body: Dict[str, Any] = {"argv": [str(a) for a in argv]}
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if timeout is not None:
        body["timeout_secs"] = float(timeout)
    if stdin is not None:
        body["stdin"] = stdin
    return body


def create_body(image: Optional[str], snapshot: Any, driver: Optional[str], name: Optional[str],
                memory: Any, cpus: Any, pids: Optional[int], services: Optional[list]) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    for k, v in (("image", image), ("snapshot", ident(snapshot) if snapshot is not None else None),
                 ("driver", driver), ("name", name)):
        if v is not None:
            body[k] = v
    limits = limits_body(memory, cpus, pids)
    if limits:
        body["limits"] = limits
    if services:
        body["services"] = list(services)
    return body


def limits_body(memory: Any, cpus: Any, pids: Optional[int]) -> Dict[str, Any]:
    limits: Dict[str, Any] = {}
    if memory is not None:
        limits["memory"] = str(memory)
    if cpus is not None:
        limits["cpus"] = str(cpus)
    if pids is not None:
        limits["pids"] = int(pids)
    return limits


def ident(x: Any) -> str:
    """An id from a record or a string."""
    return x if isinstance(x, str) else getattr(x, "id")


def diff_params(a: Any, b: Any, text_max: Optional[int], max_changes: Optional[int]) -> Dict[str, Any]:
    """The query of `GET /v1/diff`."""
    params: Dict[str, Any] = {"a": ident(a), "b": ident(b)}
    if text_max is not None:
        params["text_max"] = text_max
    if max_changes is not None:
        params["max_changes"] = max_changes
    return params


def admission_headers(idempotency_key: Optional[str], wait: Optional[float],
                      priority: Optional[int]) -> Dict[str, str]:
    """Headers of a create the server's admission queue reads: how long to
    wait for capacity (`Request-Timeout`, seconds) and the `Priority`."""
    headers = key_header(idempotency_key)
    if wait is not None:
        headers["Request-Timeout"] = str(wait)
    if priority is not None:
        headers["Priority"] = str(priority)
    return headers


def key_header(idempotency_key: Optional[str]) -> Dict[str, str]:
    return {"Idempotency-Key": idempotency_key} if idempotency_key else {}


def text_bytes(data: Any) -> Optional[bytes]:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    return None


def file_chunks(f: Any):
    while True:
        b = f.read(CHUNK)
        if not b:
            return
        yield b
