"""Exceptions carrying the API's error code and message."""

from __future__ import annotations

import json
from typing import Optional

import httpx


class CairnError(Exception):
    """A request failed. `code` is the API's stable code (`not_found`,
    `bad_request`, `conflict`, `unauthorized`, `too_large`, `unavailable`,
    `internal`), `message` its sentence for a person, `status` the HTTP
    status (0 when no response arrived)."""

    def __init__(self, message: str, *, status: int = 0, code: str = "error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} ({self.code})" if self.status else self.message


class BadRequest(CairnError):
    """400: the request was malformed or named something invalid."""


class Unauthorized(CairnError):
    """401: the bearer token is missing, mistyped or revoked."""


class NotFound(CairnError):
    """404: no such sandbox, snapshot, run, image or artifact."""


class Conflict(CairnError):
    """409: the thing is in a state that does not allow the request."""


class TooLarge(CairnError):
    """413: the upload is larger than the server accepts."""


class NoCapacity(CairnError):
    """429: the server had no capacity for the sandbox within the request's
    deadline (`Request-Timeout`); nothing was made."""


class Unavailable(CairnError):
    """503: the server cannot serve the request now."""


class ConnectError(CairnError):
    """No connection to the server could be made."""


_BY_STATUS = {400: BadRequest, 401: Unauthorized, 404: NotFound, 409: Conflict, 413: TooLarge, 429: NoCapacity,
              503: Unavailable}


def from_response(status: int, body: bytes) -> CairnError:
    """The exception for an error response's status and body."""
    code, message = "error", ""
    try:
        detail = json.loads(body)["error"]
        code, message = str(detail.get("code", code)), str(detail.get("message", ""))
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()
    if not message:
        message = f"the server answered HTTP {status}"
    return _BY_STATUS.get(status, CairnError)(message, status=status, code=code)


def from_event(data: dict) -> CairnError:
    """The exception for a streamed `error` event."""
    detail = data.get("error", data) if isinstance(data, dict) else {}
    code = str(detail.get("code", "error"))
    codes = {400: "bad_request", 401: "unauthorized", 404: "not_found", 409: "conflict", 413: "too_large",
             429: "no_capacity", 503: "unavailable"}
    status = {v: k for k, v in codes.items()}.get(code, 500)
    return _BY_STATUS.get(status, CairnError)(str(detail.get("message", "the stream failed")), status=status, code=code)


def from_transport(exc: httpx.TransportError, where: str) -> CairnError:
    """A clear error for a failed connection, naming where we tried."""
    if isinstance(exc, httpx.ConnectError):
        return ConnectError(
            f"cannot connect to the Cairn server at {where}: {exc or type(exc).__name__}; "
            "start it with `cairn serve` (or set CAIRN_URL and CAIRN_TOKEN for a remote one)",
            code="connect",
        )
    if isinstance(exc, httpx.TimeoutException):
        return CairnError(f"the Cairn server at {where} did not answer in time: {exc}", code="timeout")
    return CairnError(f"the connection to the Cairn server at {where} failed: {exc or type(exc).__name__}",
                      code="transport")
