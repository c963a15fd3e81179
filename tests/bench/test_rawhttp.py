"""The raw HTTP/1.1 transport: framing, connection reuse, failures and kernel receive stamps.

Responses come from a plain-socket server thread that writes scripted bytes
with set pauses (real TCP on 127.0.0.1), or are fed byte by byte into one
connection's parser.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import pytest

from disagg.launch.local import free_port
from disagg.tools.bench import rawhttp
from disagg.tools.bench.client import OpenAIClient, RequestResult, _RawExchange

TOKEN = b'data: {"id":"x","choices":[{"index":0,"text":" a","finish_reason":null}]}\n\n'
LAST = b'data: {"id":"x","choices":[{"index":0,"text":" a","finish_reason":"length"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":1}}}\n\n'
DONE = b"data: [DONE]\n\n"
EVENTS = [TOKEN, TOKEN, LAST, USAGE, DONE]
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return None
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += conn.recv(65536)
    return head


Script = Callable[[socket.socket, int], bool]  # (connection, request number) -> keep open


class ScriptedServer:
    """Answers each request with a script that writes bytes (and sleeps) on the socket."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.requests = 0
        self.heads: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                while (head := _read_request(conn)) is not None:
                    self.heads.append(head)
                    self.requests += 1
                    if not self.script(conn, self.requests):
                        return
            except OSError:  # the client went away mid-answer (it may: it has [DONE])
                return

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def scripted():
    servers: list[ScriptedServer] = []

    def start(script: Script) -> ScriptedServer:
        servers.append(ScriptedServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


async def _complete(url: str, n: int = 1, **kw: object) -> tuple[list[RequestResult], int]:
    async with OpenAIClient(url, model="m", transport=kw.pop("transport", "raw"), **kw) as client:
        results = [await client.complete([1, 2, 3], 3) for _ in range(n)]
        return results, client.pool.num_connections if client.pool else -1


def _send_all(response: bytes, pause_s: float = 0.0, size: int = 0) -> Script:
    """Write the response whole, or in pieces of ``size`` bytes with pauses between them."""

    def script(conn: socket.socket, _: int) -> bool:
        step = size or len(response)
        for i in range(0, len(response), step):
            conn.sendall(response[i : i + step])
            if pause_s:
                time.sleep(pause_s)
        return True

    return script


def _check_ok(r: RequestResult) -> None:
    assert r.ok, (r.error, r.error_detail)
    assert r.status == 200 and len(r.chunk_ns) == 3 and r.output_tokens == 3
    assert (r.prompt_tokens, r.cached_tokens) == (3, 1)
    assert r.send_ns < r.first_token_ns <= r.end_ns


@pytest.mark.parametrize("size", [0, 1, 7, 64])
def test_chunked_sse_split_across_reads(scripted, size: int) -> None:
    server = scripted(
        _send_all(SSE_HEAD + chunked(EVENTS), pause_s=0.001 if size else 0, size=size)
    )
    results, conns = asyncio.run(_complete(server.url, n=2, send_stamps=True))
    for r in results:
        _check_ok(r)
    assert conns == 1 and server.connections == 1  # the keep-alive connection was reused
    if rawhttp._SO_TIMESTAMPING:  # on a kept-alive connection the stamp precedes the send
        assert results[1].send_ns <= results[1].send_kernel_ns
    head = server.heads[0].decode()
    assert head.startswith("POST /v1/completions HTTP/1.1") and "x-request-id: bench-1" in head


def test_send_stamp_leaves_out_the_wait_for_a_draining_connection(scripted) -> None:
    """A request that waits for the pool's own draining connection is stamped when it gets it.

    The first response's terminator comes 200 ms after its [DONE]; the second request,
    sent as soon as the first returns, waits for that connection. Its send stamp must
    follow the terminator's write: an order, not a time bound, so a busy machine cannot
    break it, while a stamp taken before the wait would precede the write by ~200 ms.
    """
    terminator_ns: list[int] = []

    def script(conn: socket.socket, n: int) -> bool:
        if n == 1:
            conn.sendall(SSE_HEAD + chunked(EVENTS)[:-5])  # everything but 0\r\n\r\n
            time.sleep(0.2)
            terminator_ns.append(time.perf_counter_ns())
            conn.sendall(b"0\r\n\r\n")
        else:
            conn.sendall(SSE_HEAD + chunked(EVENTS))
        return True

    server = scripted(script)
    results, conns = asyncio.run(_complete(server.url, n=2))
    for r in results:
        _check_ok(r)
    assert conns == 1 and server.connections == 1  # the second request had the drained one
    assert results[1].send_ns > terminator_ns[0]


def test_every_split_point_of_one_response() -> None:
    """Feed a response to one connection's parser in two reads, cut at every byte."""
    full = SSE_HEAD + chunked([b"data: {", TOKEN[7:]] + EVENTS[1:])
    ends, pos = [], 0  # where each event's blank line ends (chunk framing has no \n\n)
    while (pos := full.find(b"\n\n", pos) + 2) > 1:
        ends.append(pos)
    assert len(ends) == len(EVENTS)

    async def feed_all() -> None:
        a, b = socket.socketpair()
        pool = rawhttp.RawHTTPPool("127.0.0.1", 1)
        conn = rawhttp._Connection(pool, a)
        try:
            for cut in range(1, len(full)):
                result = RequestResult("r", 0)
                exchange = _RawExchange(result, chat=False)
                future = asyncio.get_running_loop().create_future()
                conn.begin(exchange, future)
                conn._feed(full[:cut], 10)
                conn._feed(full[cut:], 11)
                assert future.done() and future.result() == (None, ""), cut
                assert pool._idle.pop() is conn  # body complete: back in the pool
                exchange.stream.close()
                assert result.ok and result.output_tokens == 3 and result.cached_tokens == 1, cut
                # each token is stamped with the read that completed its event
                assert result.chunk_ns == [10 if e <= cut else 11 for e in ends[:3]], cut
        finally:
            conn.close()
            b.close()

    asyncio.run(feed_all())


def test_content_length_and_until_close_bodies(scripted) -> None:
    body = b"".join(EVENTS)
    sized = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    server = scripted(_send_all(sized))
    results, conns = asyncio.run(_complete(server.url, n=2))
    assert all(r.ok for r in results) and conns == 1

    def until_close(conn: socket.socket, _: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body)
        return False  # close: the end of the body

    server = scripted(until_close)
    results, _ = asyncio.run(_complete(server.url, n=2))
    for r in results:
        _check_ok(r)
    assert server.connections == 2


def test_interim_response_and_error_status(scripted) -> None:
    def script(conn: socket.socket, n: int) -> bool:
        if n == 1:
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" + SSE_HEAD + chunked(EVENTS))
        else:
            err = b'{"error": {"message": "slow down"}}'
            conn.sendall(b"HTTP/1.1 429 Too Many\r\nContent-Length: %d\r\n\r\n%s" % (len(err), err))
        return True

    results, conns = asyncio.run(_complete(scripted(script).url, n=3))
    _check_ok(results[0])
    for r in results[1:]:
        assert r.error == "http_4xx" and r.status == 429 and "slow down" in r.error_detail
    assert conns == 1  # an error response with a body length keeps the connection


def test_server_closing_an_idle_connection(scripted) -> None:
    """Keep-alive timeout on the server: the next request goes out on a new connection."""

    def script(conn: socket.socket, _: int) -> bool:
        conn.sendall(SSE_HEAD + chunked(EVENTS))
        time.sleep(0.02)  # then close the idle connection
        return False

    results, _ = asyncio.run(_complete(scripted(script).url, n=3))
    for r in results:
        _check_ok(r)


def test_answer_at_done_and_a_body_that_never_ends(scripted) -> None:
    """[DONE] answers the request; a missing chunked terminator costs the connection only."""

    def script(conn: socket.socket, n: int) -> bool:
        if n == 1:
            conn.sendall(SSE_HEAD + chunked(EVENTS)[:-5])  # everything but 0\r\n\r\n
            time.sleep(1.5)
            return False
        conn.sendall(SSE_HEAD + chunked(EVENTS))
        return True

    async def run(url: str) -> tuple[list[RequestResult], list[int], int]:
        async with OpenAIClient(url, model="m", read_timeout_s=1.0) as client:
            results, returned = [], []
            for _ in range(2):
                results.append(await client.complete([1, 2, 3], 3))
                returned.append(time.perf_counter_ns())
            return results, returned, client.pool.num_connections

    server = scripted(script)
    results, returned, conns = asyncio.run(run(server.url))
    for r in results:
        _check_ok(r)
    # at [DONE], not after the 1 s read timeout (the margin is for a loaded machine's wake-ups)
    assert returned[0] - results[0].end_ns < 500_000_000
    assert server.connections == 2 and conns == 1  # the stalled one was dropped


def test_broken_stream_malformed_response_and_timeout(scripted) -> None:
    def broken(conn: socket.socket, _: int) -> bool:
        conn.sendall(SSE_HEAD + chunked([TOKEN])[:-5])  # one token, then the connection drops
        return False

    (r,), _ = asyncio.run(_complete(scripted(broken).url))
    assert r.error == "stream_broken" and len(r.chunk_ns) == 1

    def garbage(conn: socket.socket, _: int) -> bool:
        conn.sendall(b"SPAM/9 what\r\n\r\n")
        return True

    (r,), _ = asyncio.run(_complete(scripted(garbage).url))
    assert r.error == "other" and "bad status line" in r.error_detail

    def bad_chunk(conn: socket.socket, _: int) -> bool:
        conn.sendall(SSE_HEAD + b"zz\r\n")
        return True

    (r,), _ = asyncio.run(_complete(scripted(bad_chunk).url))
    assert r.error == "stream_broken" and r.status == 200

    def silent(conn: socket.socket, _: int) -> bool:
        conn.sendall(SSE_HEAD)
        time.sleep(0.5)
        return False

    (r,), _ = asyncio.run(_complete(scripted(silent).url, read_timeout_s=0.1))
    assert r.error == "timeout" and r.status == 200


def test_connect_failure() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        (r,), _ = asyncio.run(_complete(url))
    assert r.error == "connect" and r.status is None


def test_transport_choice() -> None:
    assert OpenAIClient("http://h:1").transport == "raw"
    assert OpenAIClient("https://h").transport == "aiohttp"
    assert OpenAIClient("http://h:1", transport="aiohttp").transport == "aiohttp"
    with pytest.raises(ValueError, match="plain http"):
        OpenAIClient("https://h", transport="raw")
    with pytest.raises(ValueError, match="base_url"):
        OpenAIClient("h:8000")


@pytest.mark.skipif(not rawhttp._SO_TIMESTAMPNS, reason="needs Linux SO_TIMESTAMPNS")
def test_kernel_stamps_survive_a_blocked_event_loop(scripted) -> None:
    """The client's event loop is stuck while the first token arrives.

    The loop blocks until the server has written the first token, then 100 ms
    more. The raw transport stamps the token inside the server's write (the
    kernel's arrival time); aiohttp stamps it when its loop comes back.

    The order is made by events, not by pauses, so a busy machine cannot
    reorder it: the server writes the first token only once the loop is stuck
    (a loop that is merely late could read the token before it blocks), and
    writes the rest only after the loop is free again, plus 200 ms for it to
    read (a later read would merge both writes, stamped by the newest byte:
    rawhttp NOTE 1). The only bound left on a measured time is the 100 us
    around the write, which holds the kernel stamp against the loop's 100 ms.
    """
    writes: list[tuple[int, int]] = []  # (before, after) the first token's write
    received, stuck, written, free = (threading.Event() for _ in range(4))

    def script(conn: socket.socket, _: int) -> bool:
        received.set()
        stuck.wait(5)
        before = time.perf_counter_ns()
        conn.sendall(SSE_HEAD + b"%x\r\n%s\r\n" % (len(TOKEN), TOKEN))
        writes.append((before, time.perf_counter_ns()))
        written.set()
        free.wait(5)
        time.sleep(0.2)
        conn.sendall(chunked(EVENTS[1:]))
        return True

    async def block() -> None:
        while not received.is_set():  # the request is out
            await asyncio.sleep(0.001)
        stuck.set()  # the loop is stuck from here ...
        written.wait(5)
        time.sleep(0.1)  # ... until 100 ms after the first token arrived
        free.set()

    async def run(url: str, transport: str) -> RequestResult:
        for event in (received, stuck, written, free):
            event.clear()
        async with OpenAIClient(url, model="m", transport=transport, send_stamps=True) as client:
            blocker = asyncio.create_task(block())
            result = await client.complete([1, 2, 3], 3)
            await blocker
            return result

    server = scripted(script)
    raw = asyncio.run(run(server.url, "raw"))
    late = asyncio.run(run(server.url, "aiohttp"))
    _check_ok(raw)
    before, after = writes[0]
    assert before - 100_000 <= raw.first_token_ns <= after + 100_000, (  # within the write
        raw.first_token_ns - before, after - before)
    assert raw.send_kernel_ns is not None and raw.send_ns <= raw.send_kernel_ns
    assert late.ok and late.first_token_ns - writes[1][1] > 90_000_000  # ~100 ms late


@pytest.mark.skipif(rawhttp._SO_TIMESTAMPNS is None, reason="kernel receive stamps are Linux-only")
def test_an_open_pool_keeps_fresh_connections_stamped() -> None:
    """rawhttp NOTE 4: while a pool is open, a fresh socket's first read carries a kernel stamp.

    Without the pool's stamping socket the kernel switches stamping on late, and a
    fresh connection's first segment often arrives unstamped; 40 connections catch
    that unless another socket on the machine happens to hold stamping on.
    """

    async def first_reads_stamped(n: int) -> list[bool]:
        pool = rawhttp.RawHTTPPool("127.0.0.1", 9)  # never connects: only its stamp holder
        assert pool.rx_stamps_live
        stamped = []
        try:
            with socket.create_server(("127.0.0.1", 0)) as listener:
                for _ in range(n):
                    with socket.create_connection(listener.getsockname()) as client:
                        client.setsockopt(socket.SOL_SOCKET, rawhttp._SO_TIMESTAMPNS, 1)
                        server, _ = listener.accept()
                        with server:
                            server.sendall(b"x")
                            _, ancdata, _, _ = client.recvmsg(16, socket.CMSG_SPACE(16))
                    stamped.append(any(kind == rawhttp._SO_TIMESTAMPNS for _, kind, _ in ancdata))
        finally:
            await pool.close()
        return stamped

    assert all(asyncio.run(first_reads_stamped(40)))


def test_against_uvicorn() -> None:
    """Interop with the ASGI server the serving stack runs on (chunked SSE, keep-alive close)."""
    uvicorn = pytest.importorskip("uvicorn")
    starlette = pytest.importorskip("starlette.applications")
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request):  # type: ignore[no-untyped-def]
        body = await request.json()
        n = body["max_tokens"]
        if n == 99:
            return JSONResponse({"error": "nope"}, status_code=400)

        async def events():  # type: ignore[no-untyped-def]
            for _ in range(n - 1):
                yield TOKEN
            yield LAST
            yield USAGE
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    app = starlette.Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    port = free_port()  # outside the ephemeral range: no client socket takes it before uvicorn binds
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=1)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    async def run() -> list[RequestResult]:
        async with OpenAIClient(f"http://127.0.0.1:{port}", model="m") as client:
            out = [await client.complete([1, 2, 3], 3), await client.complete([1, 2, 3], 99)]
            await asyncio.sleep(1.3)  # the server closes the idle connection
            out.append(await client.complete([1, 2, 3], 3))
            return out

    try:
        deadline = time.time() + 20
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        ok, bad, after_idle = asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join(10)
    _check_ok(ok)
    _check_ok(after_idle)
    assert bad.error == "http_4xx" and bad.status == 400 and "nope" in bad.error_detail
