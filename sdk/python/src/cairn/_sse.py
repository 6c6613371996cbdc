"""Server-sent events, parsed from a response's lines."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterator, List, Optional, Tuple

SseEvent = Tuple[str, Any]


class _Decoder:
    def __init__(self) -> None:
        self.kind: Optional[str] = None
        self.data: List[str] = []

    def feed(self, line: str) -> Optional[SseEvent]:
        line = line.rstrip("\r\n")
        if not line:
            if not self.data and self.kind is None:
                return None
            kind, text = self.kind or "message", "\n".join(self.data)
            self.kind, self.data = None, []
            try:
                return kind, json.loads(text) if text else None
            except ValueError:
                return kind, text
        if line.startswith(":"):
            return None  # a keep-alive comment
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self.kind = value
        elif name == "data":
            self.data.append(value)
        return None

    def flush(self) -> Optional[SseEvent]:
        return self.feed("") if (self.data or self.kind) else None


def events(lines: Iterator[str]) -> Iterator[SseEvent]:
    dec = _Decoder()
    for line in lines:
        ev = dec.feed(line)
        if ev is not None:
            yield ev
    ev = dec.flush()
    if ev is not None:
        yield ev


async def aevents(lines: AsyncIterator[str]) -> AsyncIterator[SseEvent]:
    dec = _Decoder()
    async for line in lines:
        ev = dec.feed(line)
        if ev is not None:
            yield ev
    ev = dec.flush()
    if ev is not None:
        yield ev
