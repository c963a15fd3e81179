"""Sharing one host tier between the processes of a node.

``HostTierServer`` (a thread in the owning process) serves a ``HostTier``'s
index over a Unix-domain socket; ``HostTierClient`` (any process on the node)
maps the same arena file and moves the bytes itself: the socket carries only
small control messages, never object bytes.

Protocol (little-endian), one request then one response per round trip:

    frame    := u32 body_len | body
    request  := u8 op | fields            response := u8 status | fields
    str      := u32 len | utf-8 bytes

    op  name      request fields         response fields (status 1 = ok)
    1   HELLO     -                      u64 capacity | str arena_path
    2   RESERVE   u64 nbytes | str key   u64 reservation_id | u64 offset   (0 full, 2 duplicate)
    3   COMMIT    u64 reservation_id     -
    4   ABORT     u64 reservation_id     -
    5   GET       str key                u64 lease_id | u64 offset | u64 nbytes   (0 miss)
    6   RELEASE   u64 lease_id           -
    7   CONTAINS  u32 n | n x str        n x u8
    8   DELETE    str key                -                                 (0 absent or pinned)
    9   STATS     -                      str json
    10  RESERVE_MANY  u32 n | n x (u64 nbytes | str key)   n x (u8 status | u64 reservation_id | u64 offset)
    11  COMMIT_MANY   u32 n | n x u64 reservation_id       n x u8
    12  ABORT_MANY    u32 n | n x u64 reservation_id       -
    13  GET_MANY      u32 n | n x str key                  n x (u8 status | u64 lease_id | u64 offset | u64 nbytes)
    14  RELEASE_MANY  u32 n | n x u64 lease_id             -
    15  SEAL_MANY     u8 algo | u32 n | n x u64 reservation_id   n x u8
    16  DEMOTE_MANY   u32 n | n x str key                  u32 num_present   (``HostTier.demote``)
    17  TOUCH_MANY    u32 n | n x str key                  u32 num_present   (``HostTier.touch``)
    18  HOLD_MANY     u32 n | n x str key                  u32 num_present   (``HostTier.hold``; of the keys newly held)
    19  UNHOLD_MANY   u32 n | n x str key                  u32 num_released  (``HostTier.unhold``)
    20  RECALL_MANY   u32 timeout_ms | u32 n | n x str key u32 num_stored    (``HostTier.recall``; not of this connection's holds)
    21  RECALLED      u64 after | u32 timeout_ms           u64 seq | u32 n | n x str key   (``HostTier.recalled``)

The batch ops (10-14) answer in one round trip what their single forms answer
per key: a state of 512 blocks is put in two round trips and loaded in two,
not 1,024 each. SEAL_MANY is COMMIT_MANY for objects written without their
checksum: the server computes each trailer (``checksum.seal``) over the bytes
the client wrote, then commits. A client publishing from an engine's process
thereby hands the checksum work, and the GIL it would take per object, to the
store's process (kv_transfer README, "Publishing").

A request the server cannot serve (malformed, truncated, an unknown op) gets
the reply ``0xFF | utf-8 text`` (no response starts with 0xFF) and the
connection stays open.

Leases, reservations and holds belong to the connection: when a client goes away
its pins are released, its uncommitted regions freed and its holds dropped (a
device that is gone holds nothing). A connection holds a key at most once.
RECALL_MANY and RECALLED block the connection's server thread up to their
timeout (a holder listens for recalls on a connection of its own); a listening
connection that closes is forgotten, so no recall waits for it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable, Sequence

from kv_transfer.tiers.arena import SharedArena
from kv_transfer.tiers.host import HostLease, HostTier, Reservation, put_via_reservation

log = logging.getLogger(__name__)

HELLO, RESERVE, COMMIT, ABORT, GET, RELEASE, CONTAINS, DELETE, STATS = range(1, 10)
RESERVE_MANY, COMMIT_MANY, ABORT_MANY, GET_MANY, RELEASE_MANY, SEAL_MANY, DEMOTE_MANY = range(10, 17)
TOUCH_MANY, HOLD_MANY, UNHOLD_MANY, RECALL_MANY, RECALLED = 17, 18, 19, 20, 21
_U8, _U32, _U64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<Q")
ERROR = b"\xff"  # first byte of an error reply (statuses are 0-2; HostTierServer NOTE 2)


def _pack_str(s: str) -> bytes:
    b = s.encode()
    return _U32.pack(len(b)) + b


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def take(self, st: struct.Struct) -> int:
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return v

    def str(self) -> str:
        n = self.take(_U32)
        if self.pos + n > len(self.buf):
            raise ValueError(f"a {n}-byte string field past the end of a {len(self.buf)}-byte request")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(_U32.pack(len(body)) + body)


def _recv_frame(sock: socket.socket) -> bytes | None:
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    return _recv_exact(sock, _U32.unpack(head)[0])


class HostTierServer:
    """Serves a ``HostTier`` to other processes of the node (one thread per client).

    NOTES
    1. Every lease and reservation a connection opened is released / aborted
       when the connection closes, so a crashed client never pins memory.
    2. A request that fails (malformed, truncated, an unknown op, a tier error)
       gets an error reply (``ERROR`` + text; no response starts with that byte)
       and the connection stays: closing it would release the leases the
       client's other threads still read through.
    """

    def __init__(self, tier: HostTier, socket_path: str | None = None):
        self.tier = tier
        self.socket_path = socket_path or tier.arena.path + ".sock"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)  # the owner's processes only, whatever the umask
        self._sock.listen(64)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="host-tier-server", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        leases: set[int] = set()
        reservations: set[int] = set()
        holds: set[str] = set()
        listener = f"conn-{id(conn)}"
        try:
            while True:
                body = _recv_frame(conn)
                if body is None:
                    return
                try:
                    reply = self._handle(_Reader(body), leases, reservations, holds, listener)
                except Exception as exc:  # noqa: BLE001 - NOTE 2: answer it, keep the connection
                    log.warning("host tier: bad request from a client: %r", exc)
                    reply = ERROR + repr(exc).encode()[:512]
                _send_frame(conn, reply)
        except OSError:
            return
        finally:
            for lease_id in leases:
                self.tier.release(lease_id)
            for rid in reservations:
                self.tier.abort(rid)
            if holds:
                self.tier.unhold(list(holds))
            self.tier.forget_listener(listener)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _reserve(self, key: str, nbytes: int, reservations: set[int]) -> bytes:
        res = self.tier.reserve(key, nbytes)
        if res is None:
            return _U8.pack(0) + _U64.pack(0) + _U64.pack(0)
        if res.duplicate:
            return _U8.pack(2) + _U64.pack(0) + _U64.pack(0)
        reservations.add(res.reservation_id)
        return _U8.pack(1) + _U64.pack(res.reservation_id) + _U64.pack(res.offset)

    def _get(self, key: str, leases: set[int]) -> bytes:
        got = self.tier.acquire(key)
        if got is None:
            return _U8.pack(0) + bytes(24)
        leases.add(got[0])
        return _U8.pack(1) + b"".join(_U64.pack(v) for v in got)

    def _finish(self, op: int, rid: int, reservations: set[int], algo: int = 0) -> bool:
        if rid not in reservations:
            return False
        reservations.discard(rid)
        if op == SEAL_MANY:
            try:
                return self.tier.seal(rid, algo)
            except ValueError:  # unknown algorithm, or no room for a trailer: nothing is stored
                self.tier.abort(rid)
                return False
        return self.tier.commit(rid) if op in (COMMIT, COMMIT_MANY) else self.tier.abort(rid) is None

    def _release(self, lease_id: int, leases: set[int]) -> None:
        if lease_id in leases:
            leases.discard(lease_id)
            self.tier.release(lease_id)

    def _handle(self, r: _Reader, leases: set[int], reservations: set[int], holds: set[str],
                listener: str = "") -> bytes:
        op, tier = r.take(_U8), self.tier
        if op == RESERVE_MANY:
            n = r.take(_U32)
            return b"".join(self._reserve(r.str(), nbytes, reservations)
                            for nbytes in (r.take(_U64) for _ in range(n)))
        if op in (COMMIT_MANY, ABORT_MANY):
            done = [self._finish(op, r.take(_U64), reservations) for _ in range(r.take(_U32))]
            return bytes(int(ok) for ok in done) if op == COMMIT_MANY else _U8.pack(1)
        if op == SEAL_MANY:
            algo = r.take(_U8)
            return bytes(int(self._finish(op, r.take(_U64), reservations, algo)) for _ in range(r.take(_U32)))
        if op == GET_MANY:
            return b"".join(self._get(r.str(), leases) for _ in range(r.take(_U32)))
        if op == RELEASE_MANY:
            for _ in range(r.take(_U32)):
                self._release(r.take(_U64), leases)
            return _U8.pack(1)
        if op == HELLO:
            return _U8.pack(1) + _U64.pack(tier.capacity_bytes) + _pack_str(tier.arena.path)
        if op == RESERVE:
            nbytes = r.take(_U64)
            return self._reserve(r.str(), nbytes, reservations)
        if op in (COMMIT, ABORT):  # only this connection's own reservations
            return _U8.pack(int(self._finish(op, r.take(_U64), reservations)))
        if op == GET:
            return self._get(r.str(), leases)
        if op == RELEASE:
            self._release(r.take(_U64), leases)
            return _U8.pack(1)
        if op == CONTAINS:
            keys = [r.str() for _ in range(r.take(_U32))]
            return _U8.pack(1) + bytes(int(b) for b in tier.contains(keys))
        if op == DELETE:
            return _U8.pack(int(tier.delete(r.str())))
        if op == DEMOTE_MANY:
            keys = [r.str() for _ in range(r.take(_U32))]
            return _U8.pack(1) + _U32.pack(tier.demote(keys))
        if op == TOUCH_MANY:
            keys = [r.str() for _ in range(r.take(_U32))]
            return _U8.pack(1) + _U32.pack(tier.touch(keys))
        if op == HOLD_MANY:  # a connection holds a key once
            keys = [k for k in dict.fromkeys(r.str() for _ in range(r.take(_U32))) if k not in holds]
            holds.update(keys)
            return _U8.pack(1) + _U32.pack(tier.hold(keys))
        if op == UNHOLD_MANY:
            keys = [k for k in dict.fromkeys(r.str() for _ in range(r.take(_U32))) if k in holds]
            holds.difference_update(keys)
            return _U8.pack(1) + _U32.pack(tier.unhold(keys))
        if op == RECALL_MANY:
            timeout_s = r.take(_U32) / 1000
            keys = [r.str() for _ in range(r.take(_U32))]
            return _U8.pack(1) + _U32.pack(tier.recall(keys, timeout_s, exclude=holds))
        if op == RECALLED:
            after, timeout_s = r.take(_U64), r.take(_U32) / 1000
            seq, keys = tier.recalled(listener, after, timeout_s)
            return _U8.pack(1) + _U64.pack(seq) + _U32.pack(len(keys)) + b"".join(_pack_str(k) for k in keys)
        if op == STATS:
            return _U8.pack(1) + _pack_str(json.dumps(tier.stats()))
        raise ValueError(f"unknown op {op}")

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


class HostTierClient:
    """A ``ByteStore`` over a ``HostTier`` owned by another process of this node.

    Reads are zero-copy views into the shared arena; writes reserve a region,
    copy into the arena and commit. Thread-safe (one request at a time).
    """

    def __init__(self, socket_path: str, name: str = "host"):
        self.name = name
        self.socket_path = socket_path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(socket_path)
        self._lock = threading.Lock()
        r = self._call(_U8.pack(HELLO))
        assert r.take(_U8) == 1
        self.capacity_bytes = r.take(_U64)
        self.arena = SharedArena.attach(r.str(), self.capacity_bytes)

    def _call(self, body: bytes) -> _Reader:
        with self._lock:
            _send_frame(self._sock, body)
            resp = _recv_frame(self._sock)
        if resp is None:
            raise ConnectionError("host tier server closed the connection")
        if resp[:1] == ERROR:
            raise RuntimeError(f"host tier server refused a request: {resp[1:].decode(errors='replace')}")
        return _Reader(resp)

    def reserve(self, key: str, nbytes: int) -> Reservation | None:
        r = self._call(_U8.pack(RESERVE) + _U64.pack(nbytes) + _pack_str(key))
        status, rid, offset = r.take(_U8), r.take(_U64), r.take(_U64)
        if status == 0:
            return None
        if status == 2:
            return Reservation(key, 0, -1, nbytes, None)
        view = self.arena.view[offset : offset + nbytes]
        return Reservation(key, rid, offset, nbytes, view, self._commit, self._abort)

    def _commit(self, rid: int) -> bool:
        return self._call(_U8.pack(COMMIT) + _U64.pack(rid)).take(_U8) == 1

    def _abort(self, rid: int) -> None:
        self._call(_U8.pack(ABORT) + _U64.pack(rid))

    def reserve_many(self, requests: Sequence[tuple[str, int]]) -> list[Reservation | None]:
        """``reserve`` of each (key, nbytes) in one round trip."""
        if not requests:
            return []
        body = [_U8.pack(RESERVE_MANY), _U32.pack(len(requests))]
        for key, nbytes in requests:
            body += [_U64.pack(nbytes), _pack_str(key)]
        r = self._call(b"".join(body))
        out: list[Reservation | None] = []
        for key, nbytes in requests:
            status, rid, offset = r.take(_U8), r.take(_U64), r.take(_U64)
            if status == 0:
                out.append(None)
            elif status == 2:
                out.append(Reservation(key, 0, -1, nbytes, None))
            else:
                out.append(Reservation(key, rid, offset, nbytes, self.arena.view[offset : offset + nbytes],
                                       self._commit, self._abort))
        return out

    def commit_many(self, reservations: Sequence[Reservation]) -> list[bool]:
        """``commit`` of each (non-duplicate) reservation in one round trip."""
        if not reservations:
            return []
        ids = b"".join(_U64.pack(res.reservation_id) for res in reservations)
        r = self._call(_U8.pack(COMMIT_MANY) + _U32.pack(len(reservations)) + ids)
        return [bool(b) for b in r.buf[: len(reservations)]]

    seals_remotely = True  # seal_many's checksums run in the tier owner's process

    def seal_many(self, reservations: Sequence[Reservation], algo: int) -> list[bool]:
        """Have the server checksum each (non-duplicate) reservation into its trailer and commit
        it, in one round trip (``HostTier.seal``); False where it was not stored."""
        if not reservations:
            return []
        ids = b"".join(_U64.pack(res.reservation_id) for res in reservations)
        r = self._call(_U8.pack(SEAL_MANY) + _U8.pack(algo) + _U32.pack(len(reservations)) + ids)
        return [bool(b) for b in r.buf[: len(reservations)]]

    def abort_many(self, reservations: Sequence[Reservation]) -> None:
        if reservations:
            ids = b"".join(_U64.pack(res.reservation_id) for res in reservations)
            self._call(_U8.pack(ABORT_MANY) + _U32.pack(len(reservations)) + ids)

    def get_views(self, keys: Sequence[str]) -> list[HostLease | None]:
        """``get_view`` of each key in one round trip."""
        if not keys:
            return []
        r = self._call(_U8.pack(GET_MANY) + _U32.pack(len(keys)) + b"".join(_pack_str(k) for k in keys))
        out: list[HostLease | None] = []
        for key in keys:
            status, lease_id, offset, nbytes = r.take(_U8), r.take(_U64), r.take(_U64), r.take(_U64)
            out.append(None if status == 0 else
                       HostLease(key, lease_id, self.arena.view[offset : offset + nbytes].toreadonly(), self._release))
        return out

    def release_many(self, leases: Sequence[HostLease]) -> None:
        """Release every lease: views here, then every pin in one round trip."""
        ids = [lease.lease_id for lease in leases if lease.release_view()]
        if ids:
            self._call(_U8.pack(RELEASE_MANY) + _U32.pack(len(ids)) + b"".join(_U64.pack(i) for i in ids))

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        return put_via_reservation(self, key, data)

    def get_view(self, key: str) -> HostLease | None:
        r = self._call(_U8.pack(GET) + _pack_str(key))
        status, lease_id, offset, nbytes = r.take(_U8), r.take(_U64), r.take(_U64), r.take(_U64)
        if status == 0:
            return None
        view = self.arena.view[offset : offset + nbytes].toreadonly()
        return HostLease(key, lease_id, view, self._release)

    def _release(self, lease_id: int) -> None:
        self._call(_U8.pack(RELEASE) + _U64.pack(lease_id))

    def get_bytes(self, key: str) -> bytes | None:
        lease = self.get_view(key)
        if lease is None:
            return None
        with lease:
            return bytes(lease.view)

    def contains(self, keys: Iterable[str]) -> list[bool]:
        keys = list(keys)
        r = self._call(_U8.pack(CONTAINS) + _U32.pack(len(keys)) + b"".join(_pack_str(k) for k in keys))
        r.take(_U8)
        return [bool(b) for b in r.buf[r.pos : r.pos + len(keys)]]

    def delete(self, key: str) -> bool:
        return self._call(_U8.pack(DELETE) + _pack_str(key)).take(_U8) == 1

    def _count_keys(self, op: int, keys: Sequence[str]) -> int:
        """One round trip of a keys op answered with a count (DEMOTE_MANY, TOUCH_MANY, HOLD_MANY, UNHOLD_MANY)."""
        if not keys:
            return 0
        r = self._call(_U8.pack(op) + _U32.pack(len(keys)) + b"".join(_pack_str(k) for k in keys))
        r.take(_U8)
        return r.take(_U32)

    def demote(self, keys: Sequence[str]) -> int:
        """``HostTier.demote`` in the owning process (one round trip): how many were present."""
        return self._count_keys(DEMOTE_MANY, keys)

    def touch(self, keys: Sequence[str]) -> int:
        """``HostTier.touch`` in the owning process (one round trip): how many were present."""
        return self._count_keys(TOUCH_MANY, keys)

    def hold(self, keys: Sequence[str]) -> int:
        """``HostTier.hold`` for this connection (one round trip; dropped when it closes): how
        many were present."""
        return self._count_keys(HOLD_MANY, keys)

    def unhold(self, keys: Sequence[str]) -> int:
        """``HostTier.unhold`` of keys this connection holds (one round trip): how many were
        released by their last holder."""
        return self._count_keys(UNHOLD_MANY, keys)

    def recall(self, keys: Sequence[str], timeout_s: float) -> int:
        """``HostTier.recall`` of the ``keys`` another device holds (this connection's own holds
        excluded), waiting up to ``timeout_s``: how many of them were stored when it ended."""
        if not keys:
            return 0
        ms = max(0, min(int(timeout_s * 1000), 0xFFFFFFFF))
        r = self._call(_U8.pack(RECALL_MANY) + _U32.pack(ms) + _U32.pack(len(keys))
                       + b"".join(_pack_str(k) for k in keys))
        r.take(_U8)
        return r.take(_U32)

    def recalled(self, after: int, timeout_s: float) -> tuple[int, list[str]]:
        """``HostTier.recalled`` for this connection (its listener; blocks the connection up to
        ``timeout_s``: listen on a connection of its own, ``reconnect``)."""
        ms = max(0, min(int(timeout_s * 1000), 0xFFFFFFFF))
        r = self._call(_U8.pack(RECALLED) + _U64.pack(after) + _U32.pack(ms))
        r.take(_U8)
        seq, n = r.take(_U64), r.take(_U32)
        return seq, [r.str() for _ in range(n)]

    def reconnect(self) -> HostTierClient:
        """Another client of the same tier, on a connection of its own."""
        return HostTierClient(self.socket_path, self.name)

    def stats(self) -> dict:
        r = self._call(_U8.pack(STATS))
        r.take(_U8)
        return json.loads(r.str())

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            self.arena.close()
