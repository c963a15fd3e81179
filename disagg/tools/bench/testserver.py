"""A tiny OpenAI-compatible streaming server with controlled timings.

Used by the tests and the client-overhead benchmark: a real HTTP server on
127.0.0.1 whose latencies are set, not measured, so the harness's numbers can
be checked against hand-computed values.

Timing model of one streamed completion (all waits are absolute deadlines
from the moment the handler starts, so sleep jitter does not accumulate)::

    recv ---- ttft_ms + prefill_ms_per_token * uncached ----> token 0
         token i at  first + i * itl_ms                      (i = 1 .. n-1)

Endpoints: ``POST /v1/completions`` (token-ID or text prompts, streaming or
not), ``POST /v1/chat/completions`` (minimal), ``GET /v1/models`` (one model,
``test``, without the ``disagg`` extension), ``GET /metrics`` (Prometheus
text with ``disagg_prompt_tokens_total{source=device|computed}``), and
``GET /debug/timings`` (with ``record_timings``, per ``x-request-id``: the
handler's start ``recv_ns``, each token chunk's write ``write_ns`` and the
kernel's transmit stamp of each ``tx_ns``, all ``perf_counter_ns``), and
``DELETE /v1/sessions/{id}`` (disagg's extension; the ids are kept in order).
A block-level prefix cache (unbounded) produces ``cached_tokens``.

Run it in a background thread (:class:`TestServer`), in a child process
(:class:`TestServerProcess`, for timing-sensitive work), or standalone:
``python -m disagg.tools.bench.testserver --ttft-ms 50 --itl-ms 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field

from aiohttp import web

from disagg.tools.bench import rawhttp

_NS = 1_000_000
_DONE = b"data: [DONE]\n\n"
# Listen backlog: aiohttp's default (128) drops SYNs when hundreds of lanes connect at
# once, and a dropped SYN is retried after 1 s, 3 s, ... (seconds of false TTFT).
_BACKLOG = 2048


@dataclass(slots=True)
class TestServerConfig:
    """Controlled behaviour of the test server."""

    __test__ = False  # not a pytest test class

    ttft_ms: float = 0.0  # request received -> first token
    itl_ms: float = 0.0  # gap between consecutive tokens
    prefill_ms_per_token: float = 0.0  # extra TTFT per uncached prompt token
    cache_block_size: int = 16  # prefix-cache granularity (tokens); 0 disables the cache
    fail_every: int = 0  # every n-th request fails (0: never)
    fail_status: int = 500  # status of a failed request
    break_after: int = 0  # with fail_every: break the stream after this many tokens instead
    counter_name: str = "disagg_prompt_tokens_total"  # metric exposed on /metrics
    record_timings: bool = False  # keep per-request server timestamps for /debug/timings
    api_key: str | None = None  # when set, requests must send "Authorization: Bearer <key>"


@dataclass(slots=True)
class _State:
    cache: set[int] = field(default_factory=set)
    num_requests: int = 0
    tokens_by_source: dict[str, int] = field(default_factory=lambda: {"device": 0, "computed": 0})
    timings: dict[str, dict] = field(default_factory=dict)
    ended_sessions: list[str] = field(default_factory=list)  # DELETE /v1/sessions/{id}, in order


STATE_KEY: web.AppKey[_State] = web.AppKey("state", _State)


def _prompt_tokens(prompt: object) -> list:
    if isinstance(prompt, str):
        return prompt.split()
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return prompt
    raise web.HTTPBadRequest(text='{"error": "prompt must be a string or a list of token ids"}')


def _match_and_insert(state: _State, tokens: list, block: int) -> int:
    """Cached prefix length in tokens (full blocks before the last prompt token: as in vLLM, that
    token is always computed, its logits give the first output token), then insert all full blocks.

    Keys chain Python's tuple hash (stable within one process, which is all
    an in-memory cache needs); ``block <= 0`` disables the cache.
    """
    if block <= 0:
        return 0
    key, hit, matching = 0, 0, True
    for start in range(0, len(tokens) - block + 1, block):
        key = hash((key, tuple(tokens[start : start + block])))
        if matching and key in state.cache:
            hit += block
        else:
            matching = False
            state.cache.add(key)
    return min(hit, max(len(tokens) - 1, 0) // block * block)


class _TxRecorder:
    """Kernel transmit stamps of one connection's writes (``record_timings`` only).

    A write handed to the kernel may wait there (congestion window, the
    peer's delayed ACKs) before it leaves, so the time the handler wrote a
    chunk is not when the client could have it. With ``SO_TIMESTAMPING``
    (software TX stamps keyed by the offset of each send's last byte) on a
    duplicate of the connection's socket, :meth:`finish` maps every write of
    a response to the time its last byte left::

        ... | chunk i | chunk i+1 | ... | usage | [DONE] | 0\\r\\n\\r\\n |
                    ^ E_i = E_end - sizes of every later write    ^ E_end = largest key

    A stamp (key K, time T) covers the bytes up to K not covered by an
    earlier stamp, so write i left at the T of the smallest K >= E_i.

    NOTE: queued stamps make the socket report an error condition to the
    event loop, which then wakes at once until they are read: :meth:`collect`
    after every write keeps the queue short, and stamping is off between
    streamed responses.
    """

    _SIOCOUTQNSD = 0x894B  # bytes written but not yet sent

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        fd = transport.get_extra_info("socket").fileno()
        self.sock = socket.socket(fileno=os.dup(fd))
        weakref.finalize(transport, self.sock.close)
        self.stamps: list[tuple[int, int]] = []

    def start(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, rawhttp._SO_TIMESTAMPING, rawhttp.TX_FLAGS_WITH_ID)
        rawhttp.read_tx_stamps(self.sock)  # nothing from before
        self.stamps = []

    def collect(self) -> None:
        self.stamps += rawhttp.read_tx_stamps(self.sock)

    def _unsent(self) -> int:
        return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), self._SIOCOUTQNSD, b"\0" * 4))[0]

    async def finish(self, sizes: list[int], num: int, timeout_s: float = 2.0) -> list[int] | None:
        """Transmit times of the first ``num`` writes; ``sizes``: every write's size on the wire."""
        deadline = time.perf_counter() + timeout_s
        while self._unsent() > 0 and time.perf_counter() < deadline:
            await asyncio.sleep(0.0002)
        self.collect()
        self.sock.setsockopt(socket.SOL_SOCKET, rawhttp._SO_TIMESTAMPING, 0)
        stamps, self.stamps = sorted(self.stamps), []
        if not stamps or self._unsent() > 0:
            return None
        end = stamps[-1][0]
        ends, after = [], 0
        for size in reversed(sizes):
            ends.append(end - after)
            after += size
        ends.reverse()
        out, j = [], 0
        for e in ends[:num]:
            while j < len(stamps) and stamps[j][0] < e:
                j += 1
            if j == len(stamps):
                return None
            out.append(stamps[j][1])
        return out


def _wire_size(payload_len: int, chunked: bool) -> int:
    """Bytes one write puts on the wire: a chunked frame (hex size, CRLF, payload, CRLF) or the payload."""
    return len(f"{payload_len:x}") + 2 + payload_len + 2 if chunked else payload_len


async def _sleep_until(deadline_ns: int) -> None:
    """Never returns before the deadline (uvloop's timers are in ms and may fire early)."""
    while (delay := deadline_ns - time.perf_counter_ns()) > 0:
        await asyncio.sleep(delay / 1e9)


def build_app(config: TestServerConfig) -> web.Application:
    """The aiohttp application implementing the endpoints above."""
    state = _State()
    recorders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transport -> _TxRecorder
    app = web.Application(client_max_size=1 << 30)
    app[STATE_KEY] = state

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _generate(request, chat=False)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _generate(request, chat=True)

    async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
        t_recv = time.perf_counter_ns()
        if config.api_key and request.headers.get("Authorization") != f"Bearer {config.api_key}":
            return web.json_response({"error": {"message": "bad api key"}}, status=401)
        body = json.loads(await request.read())
        state.num_requests += 1
        n = state.num_requests
        if chat:
            text = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
            tokens: list = text.split()
        else:
            tokens = _prompt_tokens(body.get("prompt"))
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        failing = config.fail_every > 0 and n % config.fail_every == 0
        if failing and not config.break_after:
            return web.json_response(
                {"error": {"message": "injected failure"}}, status=config.fail_status
            )
        cached = _match_and_insert(state, tokens, config.cache_block_size)
        state.tokens_by_source["device"] += cached
        state.tokens_by_source["computed"] += len(tokens) - cached
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": max_tokens,
            "total_tokens": len(tokens) + max_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        first = t_recv + int(
            (config.ttft_ms + config.prefill_ms_per_token * (len(tokens) - cached)) * _NS
        )
        itl = int(config.itl_ms * _NS)
        rid = request.headers.get("x-request-id", f"r{n}")
        kind = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            await _sleep_until(first + itl * (max_tokens - 1))
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " x" * max_tokens},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": " x" * max_tokens, "finish_reason": "length"}
            )
            return web.json_response(
                {"id": rid, "object": kind, "choices": [choice], "usage": usage}
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        recorder = None
        if config.record_timings and rawhttp._SO_TIMESTAMPING and request.transport is not None:
            try:
                recorder = recorders.get(request.transport)
                if recorder is None:
                    recorder = recorders[request.transport] = _TxRecorder(request.transport)
                recorder.start()
            except OSError:  # no kernel stamps here: write times only
                recorder = None
        await resp.prepare(request)
        chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
        head = json.dumps(
            {"id": rid, "object": kind + (".chunk" if chat else ""), "model": "test"}
        )[:-1]
        piece = '{"index":0,"delta":{"content":" x"},' if chat else '{"index":0,"text":" x",'
        chunk = f'data: {head},"choices":[{piece}"finish_reason":null}}]}}\n\n'.encode()
        last = f'data: {head},"choices":[{piece}"finish_reason":"length"}}]}}\n\n'.encode()
        writes: list[int] = []
        sizes: list[int] = []  # every write on the wire, for the transmit stamps
        for i in range(max_tokens):
            await _sleep_until(first + i * itl)
            if failing and i == config.break_after:
                assert request.transport is not None
                request.transport.close()  # injected mid-stream break
                return resp
            data = last if i == max_tokens - 1 else chunk
            await resp.write(data)
            if config.record_timings:
                writes.append(time.perf_counter_ns())
                sizes.append(_wire_size(len(data), chunked))
                if recorder is not None:
                    recorder.collect()
        if (body.get("stream_options") or {}).get("include_usage"):
            usage_chunk = f'data: {head},"choices":[],"usage":{json.dumps(usage)}}}\n\n'
            await resp.write(usage_chunk.encode())
            sizes.append(_wire_size(len(usage_chunk.encode()), chunked))
        await resp.write(_DONE)
        await resp.write_eof()
        if config.record_timings:
            sizes.append(_wire_size(len(_DONE), chunked))
            if chunked:
                sizes.append(5)  # the last chunk: 0\r\n\r\n
            tx = await recorder.finish(sizes, len(writes)) if recorder else None
            state.timings[rid] = {"recv_ns": t_recv, "write_ns": writes, "tx_ns": tx}
        return resp

    async def metrics(request: web.Request) -> web.Response:
        lines = [f"# TYPE {config.counter_name} counter"]
        lines += [
            f'{config.counter_name}{{source="{s}"}} {v}.0'
            for s, v in state.tokens_by_source.items()
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def models(request: web.Request) -> web.Response:
        if config.api_key and request.headers.get("Authorization") != f"Bearer {config.api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "test", "object": "model"}]})

    async def timings(request: web.Request) -> web.Response:
        out = dict(state.timings)
        if request.query.get("clear"):
            state.timings.clear()
        return web.json_response(out)

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    async def end_session(request: web.Request) -> web.Response:
        state.ended_sessions.append(request.match_info["session_id"])
        return web.json_response({"id": request.match_info["session_id"], "object": "session", "ended": True,
                                  "demoted_objects": 0})

    app.router.add_get("/debug/timings", timings)
    app.router.add_delete("/v1/sessions/{session_id}", end_session)
    return app


class TestServer:
    """Runs :func:`build_app` on 127.0.0.1 (ephemeral port) in a background thread."""

    __test__ = False

    def __init__(self, config: TestServerConfig | None = None, port: int = 0) -> None:
        self.config = config or TestServerConfig()
        self.port = port
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def __enter__(self) -> TestServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def app(self) -> web.Application:
        assert self._runner is not None, "server not started"
        return self._runner.app

    def start(self) -> TestServer:
        self._thread = threading.Thread(target=self._run, name="bench-testserver", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"test server failed to start: {self._error}")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._runner = web.AppRunner(build_app(self.config), access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port, backlog=_BACKLOG)
            loop.run_until_complete(site.start())
            host, port = self._runner.addresses[0][:2]
            self.port, self.url = port, f"http://{host}:{port}"
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None


class TestServerProcess:
    """Runs the test server in a child process, so it shares no GIL with the client.

    Timing-sensitive measurements use this: in one process, the server
    thread and the client's event loop delay each other by up to the
    interpreter's switch interval (5 ms).
    """

    __test__ = False

    def __init__(self, config: TestServerConfig | None = None) -> None:
        self.config = config or TestServerConfig()
        self.url = ""
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> TestServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self._proc is not None, "server not started"
        return self._proc.pid

    def start(self, timeout_s: float = 30.0) -> TestServerProcess:
        cmd = [
            sys.executable,
            "-m",
            "disagg.tools.bench.testserver",
            "--config-json",
            json.dumps(asdict(self.config)),
        ]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        ready = threading.Event()
        line: list[str] = []

        def read() -> None:
            line.append(self._proc.stdout.readline())  # type: ignore[union-attr]
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s) or not line[0].startswith("READY "):
            self.stop()
            raise RuntimeError(f"test server process did not start: {line[:1]}")
        self.url = line[0].split()[1]
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="controlled-timing OpenAI-compatible test server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--record-timings", action="store_true")
    parser.add_argument("--config-json", default=None, help="a full TestServerConfig as JSON")
    args = parser.parse_args(argv)
    try:
        import uvloop  # optional: a faster event loop

        uvloop.install()
    except ImportError:
        pass
    if args.config_json:
        config = TestServerConfig(**json.loads(args.config_json))
    else:
        config = TestServerConfig(
            ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, record_timings=args.record_timings
        )

    async def serve() -> None:
        runner = web.AppRunner(build_app(config), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port, backlog=_BACKLOG).start()
        host, port = runner.addresses[0][:2]
        print(f"READY http://{host}:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
