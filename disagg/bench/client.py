"""Async OpenAI-compatible streaming client that records per-request timings.

One :class:`aiohttp.ClientSession` (one HTTP/1.1 keep-alive pool) serves all
lanes. Each request is sent with ``stream: true``, ``stream_options:
{include_usage: true}``, ``ignore_eos: true`` and ``max_tokens`` set to the
trace's output length, and yields a :class:`RequestResult`:

- times are ``time.perf_counter_ns()`` stamps taken on this side: send (just
  before the request is written), each token-bearing SSE chunk's arrival, end
  (the last token chunk; the stream's end when there is none);
- output tokens come from ``usage.completion_tokens`` when present, else the
  number of token chunks; prompt and cached tokens from ``usage`` (cached:
  ``usage.prompt_tokens_details.cached_tokens``);
- failures never raise: the result carries the HTTP status and an error class
  (``connect``, ``timeout``, ``http_4xx``, ``http_5xx``, ``stream_broken``,
  ``other``).

SSE parsing works per socket read: every complete event in one read is
stamped with that read's arrival time (they arrived together), so a busy
client does not add its own parsing time between them.

A token chunk is a ``/v1/completions`` chunk with a ``text`` field, or a chat
chunk whose delta has non-empty ``content`` or ``reasoning_content`` (the
role-only first chat chunk is not a token).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import numpy as np

try:  # orjson encodes 100K-token prompts ~10x faster than json
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)

    _loads = orjson.loads
except ImportError:  # pragma: no cover - fallback without orjson

    def _dumps(obj: Any) -> bytes:
        if isinstance(obj.get("prompt"), np.ndarray):
            obj = {**obj, "prompt": obj["prompt"].tolist()}
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads

PromptMode = Literal["tokens", "text"]
Endpoint = Literal["completions", "chat"]
ERROR_CLASSES = ("connect", "timeout", "http_4xx", "http_5xx", "stream_broken", "other")


@dataclass(slots=True)
class RequestResult:
    """Measurements of one request (times: ``perf_counter_ns``)."""

    request_id: str  # sent as the x-request-id header
    send_ns: int  # just before the request was written
    first_token_ns: int | None = None  # first token chunk arrived
    end_ns: int | None = None  # stream finished (or failed)
    chunk_ns: list[int] = field(default_factory=list)  # arrival of every token chunk
    output_tokens: int = 0  # usage.completion_tokens, else token chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    status: int | None = None  # HTTP status (None: no response)
    error: str | None = None  # one of ERROR_CLASSES, None on success
    error_detail: str = ""  # short message for the error
    # Context filled in by the runner:
    session_id: str = ""  # trace session
    turn: int = 0  # trace turn
    lane: int = -1  # closed-loop lane (-1: open loop)
    salt: int = 0  # cache-busting salt of this replay
    input_length: int = 0  # trace prompt length
    expected_output: int = 0  # trace output length (max_tokens)
    warmup: bool = False  # excluded from metrics

    def __repr__(self) -> str:
        return (
            f"RequestResult({self.request_id!r}, ok={self.ok}, ttft_ms={self.ttft_ms}, "
            f"output_tokens={self.output_tokens}, error={self.error!r})"
        )

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_ns is None:
            return None
        return (self.first_token_ns - self.send_ns) / 1e6

    @property
    def e2e_ms(self) -> float | None:
        if self.end_ns is None:
            return None
        return (self.end_ns - self.send_ns) / 1e6

    @property
    def itl_ms(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None below two tokens."""
        if (
            not self.ok
            or self.output_tokens < 2
            or self.first_token_ns is None
            or self.end_ns is None
        ):
            return None
        return (self.end_ns - self.first_token_ns) / 1e6 / (self.output_tokens - 1)


def _is_plain_token(payload: bytes) -> bool:
    """A compact completions chunk carrying text and nothing else of interest.

    Anything unusual (usage, an error, a finish reason, other spacing) takes
    the full JSON path instead, so this only ever saves work.
    """
    return (
        b'"finish_reason":null' in payload
        and b'"text":' in payload
        and b'"usage"' not in payload
        and b'"error"' not in payload
        and payload.count(b'"index"') == 1
    )


def classify_status(status: int) -> str:
    if 400 <= status < 500:
        return "http_4xx"
    if status >= 500:
        return "http_5xx"
    return "other"


class OpenAIClient:
    """Streaming ``/v1/completions`` (or ``/v1/chat/completions``) client.

    Use as ``async with OpenAIClient(url) as client: await client.complete(...)``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        endpoint: Endpoint = "completions",
        prompt_mode: PromptMode = "tokens",
        max_connections: int = 0,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 600.0,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if endpoint == "chat" and prompt_mode == "tokens":
            raise ValueError("the chat endpoint takes text prompts: use prompt_mode='text'")
        if endpoint not in ("completions", "chat") or prompt_mode not in ("tokens", "text"):
            raise ValueError(f"bad endpoint/prompt_mode: {endpoint!r}/{prompt_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.prompt_mode = prompt_mode
        self.extra_body = dict(extra_body or {})
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self._path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        self._count = 0

    async def __aenter__(self) -> OpenAIClient:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, keepalive_timeout=300, enable_cleanup_closed=True
        )
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, headers=self._headers, auto_decompress=False
        )
        if self.model is None:
            self.model = await self.discover_model() or "default"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def discover_model(self) -> str | None:
        """First id listed by ``GET /v1/models``, or None."""
        try:
            text = await self.get_text("/v1/models")
            data = _loads(text).get("data") or []
            return str(data[0]["id"]) if data else None
        except Exception:
            return None

    async def get_text(self, path: str) -> str:
        """GET ``path`` (e.g. ``/metrics``); raises on HTTP errors."""
        assert self._session is not None, "use 'async with'"
        async with self._session.get(self.base_url + path) as resp:
            resp.raise_for_status()
            return await resp.text()

    def build_body(self, prompt: np.ndarray | list[int] | str, max_tokens: int, session_id: str | None = None) -> bytes:
        """Encode one request body (call off the event loop for huge prompts).

        ``session_id`` (an extension some servers use for routing affinity) is sent when given.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": int(max_tokens),
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0.0,
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if session_id:
            body["session_id"] = session_id
        body.update(self.extra_body)
        return _dumps(body)

    async def complete(
        self, prompt: np.ndarray | list[int] | str, max_tokens: int, request_id: str | None = None
    ) -> RequestResult:
        return await self.send(self.build_body(prompt, max_tokens), request_id)

    async def send(self, body: bytes, request_id: str | None = None) -> RequestResult:
        """POST an encoded body and stream the answer; never raises on failures."""
        assert self._session is not None, "use 'async with'"
        self._count += 1
        rid = request_id or f"bench-{self._count}"
        result = RequestResult(rid, time.perf_counter_ns())
        started = False
        try:
            async with self._session.post(
                self.base_url + self._path, data=body, headers={"x-request-id": rid}
            ) as resp:
                result.status = resp.status
                if resp.status != 200:
                    result.error = classify_status(resp.status)
                    result.error_detail = (await resp.text())[:300]
                    return result
                started = True
                await self._read_stream(resp, result)
        except asyncio.CancelledError:
            raise
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
            result.error, result.error_detail = "timeout", repr(exc)[:300]
        except aiohttp.ClientConnectorError as exc:
            result.error, result.error_detail = "connect", repr(exc)[:300]
        except (
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
            ValueError,
        ) as exc:
            result.error = "stream_broken" if started else "connect"
            result.error_detail = repr(exc)[:300]
        except Exception as exc:  # recorded, never raised
            result.error, result.error_detail = "other", repr(exc)[:300]
        finally:
            if result.end_ns is None:
                result.end_ns = time.perf_counter_ns()
        return result

    async def _read_stream(self, resp: aiohttp.ClientResponse, result: RequestResult) -> None:
        """Parse the SSE stream; events from one socket read share that read's timestamp."""
        chunks = result.chunk_ns
        chat = self.endpoint == "chat"
        usage = None
        done = finished = False
        pending = b""
        async for data in resp.content.iter_any():
            now = time.perf_counter_ns()
            if b"\r" in data:
                data = data.replace(b"\r\n", b"\n")
            events = (pending + data).split(b"\n\n")
            pending = events.pop()  # an incomplete event waits for the next read
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    if not chat and _is_plain_token(payload):
                        chunks.append(now)  # fast path: no JSON decode
                        continue
                    obj = _loads(payload)
                    if "error" in obj and not obj.get("choices"):
                        result.error, result.error_detail = "stream_broken", str(obj["error"])[:300]
                        return
                    for choice in obj.get("choices") or ():
                        if chat:
                            delta = choice.get("delta") or {}
                            is_token = bool(delta.get("content") or delta.get("reasoning_content"))
                        else:
                            is_token = choice.get("text") is not None
                        if is_token:
                            chunks.append(now)
                        if choice.get("finish_reason"):
                            finished = True
                    if obj.get("usage"):
                        usage = obj["usage"]
            if done:
                break
        if chunks:
            result.first_token_ns, result.end_ns = chunks[0], chunks[-1]
        result.output_tokens = len(chunks)
        if usage:
            result.output_tokens = int(usage.get("completion_tokens") or len(chunks))
            result.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
        if not (done or finished):
            result.error, result.error_detail = "stream_broken", "stream ended early"
