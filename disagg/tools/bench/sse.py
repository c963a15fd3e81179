"""OpenAI server-sent-event stream -> token arrival times and usage of one request.

Both transports (:mod:`disagg.tools.bench.rawhttp` and aiohttp) hand the decoded
response body to :class:`StreamAccumulator` as it arrives, one piece per
socket read, each with that read's arrival time::

    read k:  b'data: {..."text":" x"...}\\n\\ndata: {..."te'   arrived at t_k
    read k+1: b'xt":" y"...}\\n\\ndata: [DONE]\\n\\n'              arrived at t_k+1

Every event completed by a read is stamped with that read's time (the event's
last byte arrived then, or earlier when the read holds several events).

A token chunk is a ``/v1/completions`` chunk with a ``text`` field, or a chat
chunk whose delta has non-empty ``content`` or ``reasoning_content`` (the
role-only first chat chunk is not a token). Output tokens come from
``usage.completion_tokens`` when present, else the number of token chunks.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disagg.tools.bench.result import RequestResult

try:
    import orjson

    loads = orjson.loads
except ImportError:  # pragma: no cover - fallback without orjson
    loads = json.loads


def is_plain_token(payload: bytes) -> bool:
    """A compact completions chunk carrying text and nothing else of interest.

    Anything unusual (usage other than ``null``, an error, a finish reason,
    other spacing) takes the full JSON path instead, so this only ever saves
    work.
    """
    return (
        b'"finish_reason":null' in payload
        and b'"text":' in payload
        and payload.count(b'"usage"') == payload.count(b'"usage":null')
        and b'"error"' not in payload
        and payload.count(b'"index"') == 1
    )


# Markers of events that need the full parse (the end of a stream, usage, errors).
_SPECIAL = (b'"finish_reason":"', b"[DONE]", b'"usage":{', b'"error"')


def all_plain_tokens(events: bytes) -> int:
    """Number of events if every ``\\n\\n``-terminated event is one plain token line, else 0.

    Whole-buffer counts replace a per-event loop. Quotes inside JSON strings
    are escaped, so a key pattern such as ``"finish_reason":null`` only
    matches a real key; an event that is anything else (usage, ``[DONE]``,
    an error, a finish reason, several choices, several data lines, an empty
    event) breaks one of the equalities.
    """
    n = events.count(b"\n\n")
    if (
        events.count(b"data:") == n
        and events.count(b'"finish_reason":null') == n
        and events.count(b'"text":') == n
        and events.count(b'"index"') == n
        and events.count(b'"usage"') == events.count(b'"usage":null')
        and b'"error"' not in events
        and b"\n\n\n" not in events
    ):
        return n
    return 0


class StreamAccumulator:
    """Parses one SSE body into a :class:`RequestResult` (token stamps, usage, errors).

    ``feed(data, arrived_ns)`` per read; True once the stream is over
    (``[DONE]`` or an error event). ``close()`` once at the end fills
    ``first_token_ns``, ``end_ns``, ``output_tokens`` and the usage fields, and
    marks a stream that ended without ``[DONE]`` or a finish reason broken.
    """

    __slots__ = ("result", "chat", "pending", "usage", "done", "finished", "failed")

    def __init__(self, result: RequestResult, chat: bool) -> None:
        self.result = result
        self.chat = chat
        self.pending = b""  # an incomplete event waiting for the next read
        self.usage: dict[str, Any] | None = None
        self.done = False  # saw [DONE]
        self.finished = False  # saw a finish_reason
        self.failed = False  # saw an error event

    def feed(self, data: bytes, arrived_ns: int) -> bool:
        if self.done or self.failed:
            return True
        if self.pending:
            data = self.pending + data
        if b"\r" in data:  # CRLF line ends, also one split across reads (joined first)
            data = data.replace(b"\r\n", b"\n")
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.pending = data
            return False
        whole, self.pending = data[: cut + 2], data[cut + 2 :]
        chunks = self.result.chunk_ns
        if not self.chat:  # fast path: the plain token chunks before anything special
            special = min((i for i in map(whole.find, _SPECIAL) if i >= 0), default=len(whole))
            head = whole.rfind(b"\n\n", 0, special) + 2 if special else 0
            n = all_plain_tokens(whole[:head]) if head > 1 else 0
            if n:
                chunks.extend([arrived_ns] * n)
                whole = whole[head:]
        for event in whole.split(b"\n\n"):
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    continue
                if not self.chat and is_plain_token(payload):
                    chunks.append(arrived_ns)  # fast path: no JSON decode
                    continue
                self._event(loads(payload), arrived_ns)
                if self.failed:
                    return True
        return self.done

    def _event(self, obj: dict[str, Any], arrived_ns: int) -> None:
        if "error" in obj and not obj.get("choices"):
            r = self.result
            r.error, r.error_detail = "stream_broken", str(obj["error"])[:300]
            self.failed = True
            return
        for choice in obj.get("choices") or ():
            if self.chat:
                delta = choice.get("delta") or {}
                is_token = bool(delta.get("content") or delta.get("reasoning_content"))
            else:
                is_token = choice.get("text") is not None
            if is_token:
                self.result.chunk_ns.append(arrived_ns)
            if choice.get("finish_reason"):
                self.finished = True
        if obj.get("usage"):
            self.usage = obj["usage"]

    def close(self) -> None:
        r = self.result
        chunks = r.chunk_ns
        if chunks:
            r.first_token_ns, r.end_ns = chunks[0], chunks[-1]
        r.output_tokens = len(chunks)
        if self.usage:
            r.output_tokens = int(self.usage.get("completion_tokens") or len(chunks))
            r.prompt_tokens = self.usage.get("prompt_tokens")
            details = self.usage.get("prompt_tokens_details") or {}
            r.cached_tokens = details.get("cached_tokens")
        if r.error is None and not (self.done or self.finished):
            r.error, r.error_detail = "stream_broken", "stream ended early"
