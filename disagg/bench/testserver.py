"""A tiny OpenAI-compatible streaming server with controlled timings.

Used by the tests and the client-overhead benchmark: a real HTTP server on
127.0.0.1 whose latencies are set, not measured, so the harness's numbers can
be checked against hand-computed values.

Timing model of one streamed completion (all waits are absolute deadlines
from the moment the handler starts, so sleep jitter does not accumulate)::

    recv ---- ttft_ms + prefill_ms_per_token * uncached ----> token 0
         token i at  first + i * itl_ms                      (i = 1 .. n-1)

Endpoints: ``POST /v1/completions`` (token-ID or text prompts, streaming or
not), ``POST /v1/chat/completions`` (minimal), ``GET /metrics`` (Prometheus
text with ``disagg_prompt_tokens_total{source=device|computed}``), and
``GET /debug/timings`` (server-side timestamps per ``x-request-id``).
A block-level prefix cache (unbounded) produces ``cached_tokens``.

Run it in a background thread (:class:`TestServer`), in a child process
(:class:`TestServerProcess`, for timing-sensitive work), or standalone:
``python -m disagg.bench.testserver --ttft-ms 50 --itl-ms 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from aiohttp import web

_NS = 1_000_000


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
    """Cached prefix length in tokens (full blocks), then insert all full blocks.

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
    return hit


async def _sleep_until(deadline_ns: int) -> None:
    delay = (deadline_ns - time.perf_counter_ns()) / 1e9
    if delay > 0:
        await asyncio.sleep(delay)


def build_app(config: TestServerConfig) -> web.Application:
    """The aiohttp application implementing the endpoints above."""
    state = _State()
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
        await resp.prepare(request)
        head = json.dumps(
            {"id": rid, "object": kind + (".chunk" if chat else ""), "model": "test"}
        )[:-1]
        piece = '{"index":0,"delta":{"content":" x"},' if chat else '{"index":0,"text":" x",'
        chunk = f'data: {head},"choices":[{piece}"finish_reason":null}}]}}\n\n'.encode()
        last = f'data: {head},"choices":[{piece}"finish_reason":"length"}}]}}\n\n'.encode()
        writes: list[int] = []
        for i in range(max_tokens):
            await _sleep_until(first + i * itl)
            if failing and i == config.break_after:
                assert request.transport is not None
                request.transport.close()  # injected mid-stream break
                return resp
            await resp.write(last if i == max_tokens - 1 else chunk)
            if config.record_timings:
                writes.append(time.perf_counter_ns())
        if (body.get("stream_options") or {}).get("include_usage"):
            usage_chunk = f'data: {head},"choices":[],"usage":{json.dumps(usage)}}}\n\n'
            await resp.write(usage_chunk.encode())
        await resp.write(b"data: [DONE]\n\n")
        if config.record_timings:
            state.timings[rid] = {"recv_ns": t_recv, "write_ns": writes}
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        lines = [f"# TYPE {config.counter_name} counter"]
        lines += [
            f'{config.counter_name}{{source="{s}"}} {v}.0'
            for s, v in state.tokens_by_source.items()
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def timings(request: web.Request) -> web.Response:
        out = dict(state.timings)
        if request.query.get("clear"):
            state.timings.clear()
        return web.json_response(out)

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/timings", timings)
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
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
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

    def start(self, timeout_s: float = 30.0) -> TestServerProcess:
        cmd = [
            sys.executable,
            "-m",
            "disagg.bench.testserver",
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
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        host, port = runner.addresses[0][:2]
        print(f"READY http://{host}:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
