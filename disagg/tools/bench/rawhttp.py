"""Plain-TCP HTTP/1.1 client whose socket reads are stamped by the kernel.

The benchmark's measurement path. A client stamping chunks with its own
clock stamps them when its event loop gets to them; at a few hundred
concurrent streams that is tens of milliseconds after the bytes arrived (see
docs/bench.md, "Harness accuracy"). Here every read is a ``recvmsg`` on a
non-blocking socket (driven by ``loop.add_reader``) with ``SO_TIMESTAMPNS``
on, so it comes with the kernel's receive time, converted to the
``perf_counter_ns`` clock::

    arrived = perf_counter_ns() - (time_ns() - kernel_receive_time)

A request is one exchange on a keep-alive connection: head + body written
with ``send`` (``send_ns`` is stamped as the request starts: on a kept-alive
connection, microseconds before the ``send`` system call), then the response
head and body (``Content-Length``, chunked, or
until close) handed to an :class:`Exchange` read by read.

NOTE 1: a read's stamp is when its newest byte arrived: the kernel merges
queued segments and keeps the newest stamp. Events that arrived earlier in
the same read are stamped late by at most the read's span; a client that
keeps up reads each event alone.
NOTE 2: one connection carries one exchange at a time. The caller gets its
answer at ``[DONE]``; the connection reads the body's end (the chunked
terminator) and then rejoins the pool, and a request that finds no idle
connection waits for such a draining one rather than opening another. Idle
connections stay registered for reading, so a server closing one
(keep-alive timeout) is seen and it leaves the pool; a reused connection
that fails before any response byte is retried once on a new one.
NOTE 3: without ``SO_TIMESTAMPNS`` (not Linux) reads are stamped with
``perf_counter_ns()`` when the callback runs (``kernel_stamps`` is False).
NOTE 4: Linux stamps received segments only while some socket asks for it, and
switches stamping on later, from a kernel worker, after the first socket asks:
segments that arrive before then carry no stamp and their reads fall back to
the callback's clock. The pool therefore holds one stamping socket of its
own for its whole life (:func:`hold_rx_stamps`), opened before its first
connection, and waits (5 s at most) until a loopback TCP read comes stamped.
Plain ``http://`` only; TLS and proxies go through aiohttp (``client.py``).
"""

from __future__ import annotations

import asyncio
import platform
import socket
import struct
import sys
import time
from collections import deque
from typing import Protocol

# Linux socket options Python does not export (asm-generic values; alpha, mips, parisc and
# sparc number them differently and fall back to loop-time stamps).
_GENERIC = platform.machine() in (
    "x86_64",
    "aarch64",
    "arm64",
    "i686",
    "ppc64le",
    "riscv64",
    "s390x",
)
_LINUX = sys.platform.startswith("linux") and _GENERIC
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if _LINUX else None)
_SO_TIMESTAMPING = getattr(socket, "SO_TIMESTAMPING", 37 if _LINUX else None)
# SOF_TIMESTAMPING_TX_SOFTWARE | _SOFTWARE | _OPT_TSONLY: one software TX stamp per send
TX_FLAGS = (1 << 1) | (1 << 4) | (1 << 11)
TX_FLAGS_WITH_ID = TX_FLAGS | (1 << 7)  # + _OPT_ID: each stamp names its send's last byte
_TIMESPEC = struct.Struct("qq")
_EXTENDED_ERR = struct.Struct("IBBBBII")  # struct sock_extended_err; ee_data is the OPT_ID key
_MAX_HEAD = 64 * 1024
_READ_SIZE = 256 * 1024

# response body framing
_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)
# chunked decoding: waiting for a size line, inside data, for the CRLF after data, for trailers
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)

RETRY = "retry"  # outcome: a reused connection failed before any response byte


class Exchange(Protocol):
    """Receives one response; the pool resolves the request's future with the outcome."""

    def on_status(self, status: int) -> None: ...

    def on_body(self, data: bytes, arrived_ns: int) -> bool:
        """Body bytes of one read; True when nothing more is needed (e.g. ``[DONE]``)."""
        ...


Outcome = tuple[str | None, str]  # (error class or None or RETRY, detail)


def _parse_head(head: bytes) -> tuple[int, int | None, bool, bool]:
    """(status, content length, chunked, connection close) of a response head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"bad status line {lines[0][:80]!r}")
    status = int(parts[1])
    close = parts[0] == b"HTTP/1.0"
    length, chunked = None, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = value.endswith(b"chunked")
        elif name == b"connection":
            close = value == b"close" or (close and value != b"keep-alive")
    if chunked:
        length = None
    if status in (204, 304) or 100 <= status < 200:
        length, chunked = 0, False
    return status, length, chunked, close


def read_tx_stamps(sock: socket.socket) -> list[tuple[int, int]]:
    """Drain a socket's error queue: ``(key, perf_counter_ns)`` per kernel transmit stamp.

    Needs ``SO_TIMESTAMPING`` with ``TX_FLAGS`` (key 0) or ``TX_FLAGS_WITH_ID``
    (key: stream offset of the last byte of the send that asked for it, since
    the option was set). A stamp is taken when the data reaches the device
    (on loopback: when it is delivered), not when the application wrote it.
    """
    out: list[tuple[int, int]] = []
    while True:
        try:
            _, ancdata, _, _ = sock.recvmsg(0, 512, socket.MSG_ERRQUEUE)
        except (BlockingIOError, InterruptedError, OSError):
            return out
        stamp, key = None, 0
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPING and len(data) >= 16:
                sec, nsec = _TIMESPEC.unpack_from(data)
                stamp = time.perf_counter_ns() - (time.time_ns() - (sec * 1_000_000_000 + nsec))
            elif len(data) >= _EXTENDED_ERR.size:  # IP_RECVERR / IPV6_RECVERR
                key = _EXTENDED_ERR.unpack_from(data)[6]
        if stamp is not None:
            out.append((key, stamp))


def _whole_chunks(data: bytes) -> tuple[bytes, bool] | None:
    """Decode ``size CRLF payload CRLF ...`` in bulk; None unless exactly whole chunks.

    Splitting on CRLF gives size, payload, size, payload, ...; the sizes must
    match the payload lengths, which fails (and the caller walks the chunks
    one by one) when a payload holds a CRLF or a size line has an extension.
    The last chunk (size 0, no trailers) ends the body.
    """
    parts = data.split(b"\r\n")
    parts.pop()  # after the final CRLF
    if len(parts) % 2:
        return None
    payloads = parts[1::2]
    try:
        sizes = [int(size, 16) for size in parts[0::2]]
    except ValueError:
        return None
    if sizes != [len(payload) for payload in payloads]:
        return None
    if 0 in sizes:
        if sizes.index(0) != len(sizes) - 1:
            return None
        return b"".join(payloads), True
    return b"".join(payloads), False


class _Connection:
    """One keep-alive TCP connection (see the module NOTEs)."""

    __slots__ = (
        "pool", "sock", "fd", "exchange", "future", "reused", "state", "head", "left",
        "chunk_state", "cbuf", "keep_alive", "got_bytes", "status_seen", "last_ns",
        "draining", "closed", "timer",
    )  # fmt: skip

    def __init__(self, pool: RawHTTPPool, sock: socket.socket) -> None:
        self.pool, self.sock, self.fd = pool, sock, sock.fileno()
        self.exchange: Exchange | None = None
        self.future: asyncio.Future[Outcome] | None = None
        self.reused = False  # carried an earlier exchange
        self.state = _HEAD
        self.head = b""  # partial response head
        self.left = 0  # body bytes left (_LENGTH) or in the current chunk (_CHUNKED)
        self.chunk_state = _SIZE
        self.cbuf = b""  # partial chunk-size line / CRLF / trailers
        self.keep_alive = True
        self.got_bytes = False  # any response byte for the current exchange
        self.status_seen = False
        self.last_ns = 0  # last read (perf_counter_ns), for the read timeout
        self.draining = False  # the exchange has its answer; reading the rest of the body
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None
        pool.loop.add_reader(self.fd, self._on_readable)

    # -- exchange lifecycle ----------------------------------------------------
    def begin(self, exchange: Exchange, future: asyncio.Future[Outcome]) -> None:
        assert self.exchange is None and not self.draining, "connection busy"
        self.exchange, self.future = exchange, future
        self.state, self.head, self.cbuf, self.chunk_state = _HEAD, b"", b"", _SIZE
        self.got_bytes = self.status_seen = False
        self.keep_alive = True
        self.last_ns = time.perf_counter_ns()
        self._arm(self.pool.read_timeout_s)

    def _arm(self, delay_s: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.pool.loop.call_later(delay_s, self._check_timeout)

    def _check_timeout(self) -> None:
        self.timer = None
        if self.closed or (self.exchange is None and not self.draining):
            return
        limit = self.pool.drain_timeout_s if self.draining else self.pool.read_timeout_s
        idle = (time.perf_counter_ns() - self.last_ns) / 1e9
        if idle < limit:
            self._arm(limit - idle)
        elif self.draining:  # the body's end never came: the connection cannot be reused
            self.close()
        else:
            self._fail("timeout", f"no data for {idle:.1f} s")

    def _resolve(self, outcome: Outcome) -> None:
        future, self.future, self.exchange = self.future, None, None
        if future is not None and not future.done():
            future.set_result(outcome)

    def _fail(self, error: str | None, detail: str) -> None:
        self._resolve((error, detail))
        self.close()

    def _complete(self) -> None:
        """The response body ended."""
        self._resolve((None, ""))
        self._stop_draining()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.keep_alive and not self.closed:
            self.reused = True
            self.pool._release(self)
        else:
            self.close()

    def _stop_draining(self) -> None:
        if self.draining:
            self.draining = False
            self.pool.num_draining -= 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        was_draining = self.draining
        self._stop_draining()
        if self.timer is not None:
            self.timer.cancel()
        self.pool.loop.remove_reader(self.fd)
        self.pool._forget(self)
        self.sock.close()
        if was_draining:  # a request waiting for it opens a new connection now
            self.pool._hand_to_waiter(self)
        if self.future is not None:
            self._resolve(("stream_broken" if self.status_seen else "connect", "connection closed"))

    # -- reading ----------------------------------------------------------------
    def _on_readable(self) -> None:
        pool = self.pool
        try:
            n, ancdata, _flags, _addr = self.sock.recvmsg_into(pool.bufs, pool.anc_size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(f"{type(exc).__name__}: {exc}")
            return
        now = time.perf_counter_ns()
        arrived = now
        for level, kind, data in ancdata:
            if kind == _SO_TIMESTAMPNS and level == socket.SOL_SOCKET and len(data) >= 16:
                sec, nsec = _TIMESPEC.unpack_from(data)
                lag = time.time_ns() - (sec * 1_000_000_000 + nsec)
                if lag > 0:
                    arrived = now - lag
                if pool.read_lags_ns is not None:
                    pool.read_lags_ns.append(max(lag, 0))
        if n == 0:
            self._lost("")
            return
        self.last_ns = now
        if self.exchange is None and not self.draining:
            self.close()  # bytes nobody asked for: the connection's state is unknown
            return
        self.got_bytes = True
        try:
            self._feed(pool.view[:n].tobytes(), arrived)
        except Exception as exc:  # a malformed response (or a parser bug)
            if self.draining:  # after the answer was complete: only the connection is lost
                self.close()
            else:
                self._fail("stream_broken" if self.status_seen else "other", repr(exc)[:300])

    def _lost(self, detail: str) -> None:
        """EOF (detail '') or a socket error."""
        if self.draining or (
            self.exchange is not None and self.state == _UNTIL_CLOSE and not detail
        ):
            self.keep_alive = False
            self._complete()
            return
        if self.exchange is not None and self.reused and not self.got_bytes:
            self._resolve((RETRY, detail))
        elif self.exchange is not None:
            error = "stream_broken" if self.status_seen else "connect"
            self._resolve((error, detail or "connection closed by the server"))
        self.close()

    def _feed(self, data: bytes, arrived: int) -> None:
        if self.state == _HEAD:
            buf = self.head + data if self.head else data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise ValueError("response head over 64 KiB")
                self.head = buf
                return
            self.head = b""
            status, length, chunked, close = _parse_head(buf[:end])
            data = buf[end + 4 :]
            if 100 <= status < 200:  # interim response: the real head follows
                if data:
                    self._feed(data, arrived)
                return
            self.status_seen = True
            self.keep_alive = not close
            if chunked:
                self.state, self.chunk_state, self.left = _CHUNKED, _SIZE, 0
            elif length is not None:
                self.state, self.left = _LENGTH, length
            else:
                self.state, self.keep_alive = _UNTIL_CLOSE, False
            if self.exchange is not None:
                self.exchange.on_status(status)
            if self.state == _LENGTH and self.left == 0:
                self._complete()
                return
            if not data:
                return
        if self.state == _CHUNKED:
            body, complete = self._dechunk(data)
        elif self.state == _LENGTH:
            body = data[: self.left]
            self.left -= len(body)
            complete = self.left == 0
            if len(data) > len(body):
                self.keep_alive = False  # more bytes than announced: do not reuse
        else:
            body, complete = data, False
        if body and self.exchange is not None:
            if self.exchange.on_body(body, arrived) and not complete:
                self._resolve((None, ""))  # the caller has its answer ([DONE]) now
                self.draining = True  # the body's end follows (briefly: drain_timeout_s)
                self.pool.num_draining += 1
                self._arm(self.pool.drain_timeout_s)
        if complete:
            self._complete()

    def _dechunk(self, data: bytes) -> tuple[bytes, bool]:
        """Decode chunked framing; (body bytes, body complete)."""
        if self.chunk_state == _SIZE and not self.cbuf and data.endswith(b"\r\n"):
            whole = _whole_chunks(data)  # fast path: the read holds whole chunks only
            if whole is not None:
                return whole
        buf = self.cbuf + data if self.cbuf else data
        self.cbuf = b""
        out: list[bytes] = []
        pos, end = 0, len(buf)
        while pos < end:
            state = self.chunk_state
            if state == _DATA:
                take = min(self.left, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self.left -= take
                if self.left == 0:
                    self.chunk_state = _DATA_END
            elif state == _DATA_END:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                pos += 2
                self.chunk_state = _SIZE
            else:  # _SIZE or _TRAILER: one CRLF-terminated line
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > 4096:
                        raise ValueError("chunk-size or trailer line too long")
                    break
                line = buf[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    if not line:  # the blank line ending the body
                        if pos < end:
                            self.keep_alive = False
                        return b"".join(out), True
                    continue
                self.left = int(line.split(b";", 1)[0], 16)
                self.chunk_state = _DATA if self.left else _TRAILER
        if pos < end:
            self.cbuf = buf[pos:]
        return b"".join(out), False


def hold_rx_stamps(timeout_s: float = 5.0) -> tuple[socket.socket | None, bool]:
    """A socket that keeps the kernel's receive stamps on, and whether they are on (NOTE 4).

    The socket is the stamped end of a loopback TCP pair. Returns once a byte
    its peer sent arrived stamped (True), or after ``timeout_s`` without one
    (False: the socket still holds stamping on; reads may be loop-stamped until
    the kernel catches up). A TCP read is the proof: for a datagram the kernel
    fills a missing stamp in at read time. ``(None, False)`` where no loopback
    socket can be made. Close the socket when done.
    """
    try:
        listener = socket.create_server(("127.0.0.1", 0))
    except OSError:
        return None, False
    holder = None
    try:
        with listener:
            holder = socket.create_connection(listener.getsockname(), timeout=timeout_s)
            holder.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            peer, _ = listener.accept()
        with peer:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                peer.sendall(b"\0")
                _, ancdata, _, _ = holder.recvmsg(1, socket.CMSG_SPACE(16))
                if any(kind == _SO_TIMESTAMPNS for _, kind, _ in ancdata):
                    return holder, True
                time.sleep(0.001)
    except OSError:
        pass
    return holder, False


class RawHTTPPool:
    """Keep-alive connections to one ``host:port``; ``request`` runs one exchange.

    Use inside a running event loop; ``await close()`` when done.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int = 0,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 600.0,
        kernel_stamps: bool = True,
        send_stamps: bool = False,
    ) -> None:
        if max_connections < 0 or connect_timeout_s <= 0 or read_timeout_s <= 0:
            raise ValueError("max_connections must be >= 0 and timeouts > 0")
        self.host, self.port = host, port
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.drain_timeout_s = min(1.0, read_timeout_s)  # rest of a body after [DONE]
        self.kernel_stamps = kernel_stamps and _SO_TIMESTAMPNS is not None
        self.send_stamps = send_stamps and _SO_TIMESTAMPING is not None
        self.anc_size = socket.CMSG_SPACE(16) + socket.CMSG_SPACE(48) if self.kernel_stamps else 0
        self._buf = bytearray(_READ_SIZE)  # one read buffer: all reads run on this loop
        self.view = memoryview(self._buf)
        self.bufs = [self._buf]
        self.read_lags_ns: list[int] | None = None  # set to [] to record read - arrival gaps
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self.num_draining = 0  # connections reading the end of an answered response
        self._waiters: deque[asyncio.Future[_Connection]] = deque()  # for a draining one
        self._slots = asyncio.Semaphore(max_connections) if max_connections else None
        self._addr: tuple | None = None
        self._family = socket.AF_INET
        # NOTE 4: a socket holding receive stamping on; rx_stamps_live: seen on before any request
        self._stamp_holder, self.rx_stamps_live = hold_rx_stamps() if self.kernel_stamps else (None, False)

    @property
    def num_connections(self) -> int:
        return len(self._all)

    def _release(self, conn: _Connection) -> None:
        if not self._hand_to_waiter(conn):
            self._idle.append(conn)

    def _hand_to_waiter(self, conn: _Connection) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    async def _connect(self) -> _Connection:
        if self._addr is None:
            try:  # a numeric address resolves at once, without the resolver thread
                infos = socket.getaddrinfo(
                    self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST
                )
            except socket.gaierror:
                infos = await self.loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            if not infos:
                raise OSError(f"cannot resolve {self.host}")
            self._family, _, _, _, self._addr = infos[0]
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.kernel_stamps:
                sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            if self.send_stamps:
                sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPING, TX_FLAGS)
            await asyncio.wait_for(self.loop.sock_connect(sock, self._addr), self.connect_timeout_s)
        except BaseException:
            sock.close()
            raise
        conn = _Connection(self, sock)
        self._all.add(conn)
        return conn

    async def _acquire(self) -> tuple[_Connection, bool]:
        """An idle connection, a draining one once free, or a new one; (conn, waited)."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn, False
        if self.num_draining > len(self._waiters):  # one is about to be free: no new socket
            waiter: asyncio.Future[_Connection] = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                conn = await asyncio.wait_for(waiter, self.drain_timeout_s)
                if not conn.closed:
                    return conn, True
            except asyncio.TimeoutError:
                pass
        return await self._connect(), False

    def _tx_stamp(self, sock: socket.socket) -> int | None:
        """perf_counter_ns of the kernel's transmit stamp of the last send, if queued."""
        stamps = read_tx_stamps(sock)
        return stamps[-1][1] if stamps else None

    async def request(self, data: bytes, exchange: Exchange, stamp: list[int | None]) -> Outcome:
        """Send ``data`` (head + body) and run the exchange to its end.

        ``stamp`` receives ``[send_ns, kernel_tx_ns]``: perf_counter_ns when
        the request starts (before a connection is taken from the pool or
        opened: a new connection's setup counts, as a user would see it; a
        wait for this pool's own draining connection does not), and the
        kernel's transmit time of the request's last byte (None without
        ``send_stamps``). Never raises on network errors: the outcome carries
        the error class.
        """
        if self._slots is not None:
            await self._slots.acquire()
        stamp[0] = time.perf_counter_ns()
        conn: _Connection | None = None
        try:
            for attempt in range(2):  # the retry goes out on a new connection
                try:
                    if attempt == 0:
                        conn, waited = await self._acquire()
                        if waited:  # the client's own bookkeeping, not the request's latency
                            stamp[0] = time.perf_counter_ns()
                    else:
                        conn = await self._connect()
                except asyncio.TimeoutError:
                    return "connect", f"connect timed out after {self.connect_timeout_s:g} s"
                except OSError as exc:
                    return "connect", f"{type(exc).__name__}: {exc}"[:300]
                outcome = await self._exchange(conn, data, exchange, stamp)
                if outcome[0] != RETRY:
                    return outcome
            return "connect", "connection closed before the response"
        except asyncio.CancelledError:
            if conn is not None and conn.exchange is exchange:
                conn.close()  # the response would arrive for nobody
            raise
        finally:
            if self._slots is not None:
                self._slots.release()

    async def _exchange(
        self, conn: _Connection, data: bytes, exchange: Exchange, stamp: list[int | None]
    ) -> Outcome:
        future: asyncio.Future[Outcome] = self.loop.create_future()
        conn.begin(exchange, future)
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            sent = -1
            conn._lost(f"{type(exc).__name__}: {exc}")
        if 0 <= sent < len(data):
            try:
                await self.loop.sock_sendall(conn.sock, memoryview(data)[sent:])
            except OSError as exc:
                if not future.done():
                    conn._lost(f"{type(exc).__name__}: {exc}")
        if self.send_stamps and not conn.closed:
            stamp[1] = self._tx_stamp(conn.sock)
        return await future

    async def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        if self._stamp_holder is not None:
            self._stamp_holder.close()
            self._stamp_holder = None
