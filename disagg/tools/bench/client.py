"""Async OpenAI-compatible streaming client that records per-request timings.

Each request is sent with ``stream: true``, ``stream_options:
{include_usage: true}``, ``ignore_eos: true`` and ``max_tokens`` set to the
trace's output length, and yields a :class:`RequestResult`:

- times are ``time.perf_counter_ns()`` values: send (the request starts),
  each token-bearing SSE chunk's arrival, end (the last token chunk; the
  stream's end when there is none);
- output tokens come from ``usage.completion_tokens`` when present, else the
  number of token chunks; prompt and cached tokens from ``usage`` (cached:
  ``usage.prompt_tokens_details.cached_tokens``);
- failures never raise: the result carries the HTTP status and an error class
  (``connect``, ``timeout``, ``http_4xx``, ``http_5xx``, ``stream_broken``,
  ``other``).

Two transports carry the streamed POSTs (``transport=``):

- ``raw`` (the default for ``http://`` URLs): :mod:`disagg.tools.bench.rawhttp`, a
  small HTTP/1.1 client on non-blocking sockets whose reads carry the
  kernel's receive timestamp (``SO_TIMESTAMPNS``), so a chunk's time is when
  it reached this host, not when the event loop got to it; the send time is
  stamped as the request starts (on a kept-alive connection, microseconds
  before the ``send`` system call);
- ``aiohttp`` (``https://``, or on request): one ``aiohttp.ClientSession``;
  chunks are stamped when the event loop reads them, which lags behind the
  socket once the loop is busy (tens of ms at hundreds of streams).

SSE parsing (:mod:`disagg.tools.bench.sse`) works per socket read: every complete
event in one read is stamped with that read's arrival time.
``GET`` helpers (``/v1/models``, ``/metrics``) always use aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal
from urllib.parse import quote, urlsplit

import aiohttp
import numpy as np

from disagg.tools.bench.rawhttp import RawHTTPPool
from disagg.tools.bench.result import ERROR_CLASSES, RequestResult  # noqa: F401 - re-exported
from disagg.tools.bench.sse import StreamAccumulator, loads

try:  # orjson encodes 100K-token prompts ~10x faster than json
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)

except ImportError:  # pragma: no cover - fallback without orjson

    def _dumps(obj: Any) -> bytes:
        if isinstance(obj.get("prompt"), np.ndarray):
            obj = {**obj, "prompt": obj["prompt"].tolist()}
        return json.dumps(obj, separators=(",", ":")).encode()


PromptMode = Literal["tokens", "text"]
Endpoint = Literal["completions", "chat"]
Transport = Literal["auto", "raw", "aiohttp"]


def classify_status(status: int) -> str:
    if 400 <= status < 500:
        return "http_4xx"
    if status >= 500:
        return "http_5xx"
    return "other"


class OpenAIClient:
    """Streaming ``/v1/completions`` (or ``/v1/chat/completions``) client.

    Use as ``async with OpenAIClient(url) as client: await client.complete(...)``.
    ``transport``: ``auto`` (raw for ``http://``, aiohttp for ``https://``),
    ``raw`` or ``aiohttp`` (see the module docstring). ``send_stamps`` (raw
    only) also records each request's kernel transmit time in
    ``RequestResult.send_kernel_ns``, to check the send stamp against.
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
        transport: Transport = "auto",
        send_stamps: bool = False,
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
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be http(s)://host[:port][/prefix], got {base_url!r}")
        if transport not in ("auto", "raw", "aiohttp"):
            raise ValueError(f"transport must be auto, raw or aiohttp, got {transport!r}")
        if transport == "raw" and url.scheme != "http":
            raise ValueError("the raw transport speaks plain http://; use transport='aiohttp'")
        self.transport = "aiohttp" if transport == "aiohttp" or url.scheme != "http" else "raw"
        self._host, self._port = url.hostname, url.port or 80
        self._connect_timeout_s, self._read_timeout_s = connect_timeout_s, read_timeout_s
        self._send_stamps = send_stamps
        head = [f"POST {url.path}{self._path} HTTP/1.1", f"Host: {url.netloc}"]
        head += [f"{k}: {v}" for k, v in self._headers.items()]
        self._raw_head = ("\r\n".join(head) + "\r\n").encode("latin-1")
        self.pool: RawHTTPPool | None = None

    async def __aenter__(self) -> OpenAIClient:
        if self.transport == "raw":
            self.pool = RawHTTPPool(
                self._host,
                self._port,
                max_connections=self._max_connections,
                connect_timeout_s=self._connect_timeout_s,
                read_timeout_s=self._read_timeout_s,
                send_stamps=self._send_stamps,
            )
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
        if self.pool is not None:
            await self.pool.close()
            self.pool = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def discover_model(self) -> str | None:
        """First id listed by ``GET /v1/models``, or None."""
        try:
            text = await self.get_text("/v1/models")
            data = loads(text).get("data") or []
            return str(data[0]["id"]) if data else None
        except Exception:
            return None

    async def end_session(self, session_id: str) -> bool:
        """``DELETE /v1/sessions/{session_id}`` (disagg's extension: the session is over); whether
        the server took it (2xx). Never raises: a failure is the caller's to count."""
        assert self._session is not None, "use 'async with'"
        try:
            async with self._session.delete(self.base_url + "/v1/sessions/" + quote(session_id, safe="")) as resp:
                await resp.read()
                return 200 <= resp.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def get_text(self, path: str) -> str:
        """GET ``path`` (e.g. ``/metrics``); raises on HTTP errors."""
        assert self._session is not None, "use 'async with'"
        async with self._session.get(self.base_url + path) as resp:
            resp.raise_for_status()
            return await resp.text()

    def build_body(
        self,
        prompt: np.ndarray | list[int] | str,
        max_tokens: int,
        session_id: str | None = None,
        session_end: bool = False,
    ) -> bytes:
        """Encode one request body (call off the event loop for huge prompts).

        ``session_id`` (an extension some servers use for routing affinity) is sent when given;
        ``session_end`` (disagg's extension: the session's last turn) with it.
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
            if session_end:
                body["session_end"] = True
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
        if self.pool is not None:
            await self._send_raw(body, result)
        else:
            await self._send_aiohttp(body, result)
        if result.end_ns is None:
            result.end_ns = time.perf_counter_ns()
        return result

    async def _send_raw(self, body: bytes, result: RequestResult) -> None:
        assert self.pool is not None
        exchange = _RawExchange(result, self.endpoint == "chat")
        extra = f"x-request-id: {result.request_id}\r\nContent-Length: {len(body)}\r\n\r\n"
        stamp: list[int | None] = [None, None]
        error, detail = await self.pool.request(
            self._raw_head + extra.encode("latin-1") + body, exchange, stamp
        )
        if stamp[0] is not None:
            result.send_ns = stamp[0]
        result.send_kernel_ns = stamp[1]
        if result.status is not None and result.status != 200:
            result.error = classify_status(result.status)
            result.error_detail = bytes(exchange.error_body or b"").decode("utf-8", "replace")
            return
        if error is not None and result.error is None:
            result.error, result.error_detail = error, detail[:300]
        if result.status == 200:
            exchange.stream.close()

    async def _send_aiohttp(self, body: bytes, result: RequestResult) -> None:
        assert self._session is not None
        started = False
        try:
            async with self._session.post(
                self.base_url + self._path, data=body, headers={"x-request-id": result.request_id}
            ) as resp:
                result.status = resp.status
                if resp.status != 200:
                    result.error = classify_status(resp.status)
                    result.error_detail = (await resp.text())[:300]
                    return
                started = True
                stream = StreamAccumulator(result, self.endpoint == "chat")
                try:
                    async for data in resp.content.iter_any():
                        if stream.feed(data, time.perf_counter_ns()):
                            break
                finally:
                    stream.close()
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


class _RawExchange:
    """Feeds one raw-transport response into the result (SSE on 200, error text otherwise)."""

    __slots__ = ("result", "stream", "error_body")

    def __init__(self, result: RequestResult, chat: bool) -> None:
        self.result = result
        self.stream = StreamAccumulator(result, chat)
        self.error_body: bytearray | None = None  # first 300 bytes of a non-200 body

    def on_status(self, status: int) -> None:
        self.result.status = status
        if status != 200:
            self.error_body = bytearray()

    def on_body(self, data: bytes, arrived_ns: int) -> bool:
        if self.error_body is None:
            return self.stream.feed(data, arrived_ns)
        if len(self.error_body) < 300:
            self.error_body += data[: 300 - len(self.error_body)]
        return False
