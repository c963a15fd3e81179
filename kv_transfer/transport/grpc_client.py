"""The client side of the state service: ``RemoteStore``, a peer seen as a ``ByteStore``.

See ``grpc_transport`` for the protocol (methods, framing, auth).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc

from kv_transfer.transport.framing import (
    Chunk,
    FlagBatch,
    FramingError,
    KeyBatch,
    Reassembler,
    ServerStats,
    batched,
    check_key,
    chunk_object,
)
from kv_transfer.transport.grpc_protocol import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    TOKEN_METADATA_KEY,
    MiB,
    TlsClientConfig,
    check_sizes,
    check_token,
    method_path,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RemoteStoreConfig:
    """How a node reaches one peer's StateServer."""

    address: str  # peer "host:port"
    token: str  # shared secret presented on every call
    timeout_s: float = 5.0  # deadline of each call (Push adds size / min_push_bytes_per_s)
    min_push_bytes_per_s: float = 100e6  # Push deadline allowance per byte
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # Push payload bytes per frame
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # gRPC send/receive limit
    max_object_bytes: int = 1 << 30  # largest object accepted from Fetch
    max_keys_per_call: int = 1024  # keys per Contains / Fetch / Delete call
    max_inflight_push_bytes: int = 256 * MiB  # bytes being pushed at once (all threads)
    reconnect_after_failures: int = 2  # consecutive UNAVAILABLE before a new channel
    min_reconnect_interval_s: float = 0.5  # at most one new channel per interval
    tls: TlsClientConfig | None = None  # None = plaintext

    def __post_init__(self) -> None:
        check_token(self.token)
        check_sizes(self.chunk_bytes, self.max_message_bytes)
        if self.timeout_s <= 0 or self.min_push_bytes_per_s <= 0:
            raise ValueError("timeout_s and min_push_bytes_per_s must be positive")
        if self.max_keys_per_call <= 0 or self.max_inflight_push_bytes <= 0:
            raise ValueError("max_keys_per_call and max_inflight_push_bytes must be positive")


class _ByteBudget:
    """Bounds bytes in flight; one oversize request may run alone."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_flight = 0
        self._cond = threading.Condition()

    def acquire(self, num_bytes: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.in_flight and self.in_flight + num_bytes > self.capacity:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self.in_flight += num_bytes
            return True

    def release(self, num_bytes: int) -> None:
        with self._cond:
            self.in_flight -= num_bytes
            assert self.in_flight >= 0, "released more bytes than acquired"
            self._cond.notify_all()


_ERROR_COUNTERS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeouts",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.UNAUTHENTICATED: "auth_failures",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected",
    grpc.StatusCode.INVALID_ARGUMENT: "rejected",
}


class RemoteStore:
    """A peer's StateServer seen as a ``ByteStore`` (``name == "remote:<addr>"``).

    NOTES
    1. No method raises for transport trouble and none blocks past its
       deadline: failures read as misses / False and are counted in ``stats()``.
    2. A returned object is complete: its length equals the total the server
       announced, else it is dropped and counted in ``corrupt_frames``.
    3. Push bytes in flight (all threads together) stay below
       ``max_inflight_push_bytes``, except one object larger than that, alone.

    Args:
        config: peer address, token, deadlines, limits and TLS.
    """

    def __init__(self, config: RemoteStoreConfig):
        self.config = config
        self.name = f"remote:{config.address}"
        self._metadata = ((TOKEN_METADATA_KEY, config.token),)
        self._budget = _ByteBudget(config.max_inflight_push_bytes)
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(
            (
                "hits", "misses", "timeouts", "unavailable", "auth_failures", "rejected",
                "errors", "corrupt_frames", "reconnects", "bytes_fetched", "bytes_pushed",
                "puts_ok", "puts_failed", "demoted",
            ),
            0,
        )  # fmt: skip
        self._auth_logged = False
        self._closed = False
        self._num_unavailable_in_row = 0
        self._last_connect = 0.0
        self._channel: grpc.Channel | None = None
        self._connect()

    # --- channel ----------------------------------------------------------

    def _connect(self) -> None:
        cfg = self.config
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if cfg.tls is None:
            channel = grpc.insecure_channel(cfg.address, options=options)
        else:
            if cfg.tls.server_name:
                options.append(("grpc.ssl_target_name_override", cfg.tls.server_name))
            creds = grpc.ssl_channel_credentials(
                root_certificates=cfg.tls.root_ca,
                private_key=cfg.tls.private_key,
                certificate_chain=cfg.tls.cert_chain,
            )
            channel = grpc.secure_channel(cfg.address, creds, options=options)
        # The previous channel is dropped, not closed: calls still running on it
        # finish or fail on their own, and it is released when they let go of it.
        self._channel = channel
        self._contains = channel.unary_unary(method_path("Contains"))
        self._fetch = channel.unary_stream(method_path("Fetch"))
        self._push = channel.stream_unary(method_path("Push"))
        self._delete = channel.unary_unary(method_path("Delete"))
        self._demote = channel.unary_unary(method_path("Demote"))
        self._stats = channel.unary_unary(method_path("Stats"))
        self._last_connect = time.monotonic()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the channel is connected (or ``timeout_s`` passes)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
            return True
        except grpc.FutureTimeoutError:
            return False

    def close(self) -> None:
        """Terminal: later calls miss at once. Do not close while other threads are calling."""
        with self._lock:
            self._closed = True
            if self._channel is not None:
                self._channel.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- accounting -------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def stats(self) -> dict[str, int]:
        """Counters since construction (hits, misses, timeouts, auth_failures, ...)."""
        with self._lock:
            return dict(self._counters)

    def _on_success(self) -> None:
        with self._lock:
            self._num_unavailable_in_row = 0

    def _on_error(self, what: str, err: grpc.RpcError) -> None:
        code = err.code() if hasattr(err, "code") else None
        self._count(_ERROR_COUNTERS.get(code, "errors"))
        if code == grpc.StatusCode.UNAUTHENTICATED:
            with self._lock:
                first, self._auth_logged = not self._auth_logged, True
            if first:
                logger.error(
                    "%s refused our token (UNAUTHENTICATED); every call will miss until "
                    "the shared secret matches",
                    self.name,
                )
        elif code == grpc.StatusCode.UNAVAILABLE:
            with self._lock:
                self._num_unavailable_in_row += 1
                reconnect = (
                    not self._closed
                    and self._num_unavailable_in_row >= self.config.reconnect_after_failures
                    and time.monotonic() - self._last_connect
                    >= self.config.min_reconnect_interval_s
                )
                if reconnect:
                    self._num_unavailable_in_row = 0
                    self._counters["reconnects"] += 1
                    self._connect()
        logger.debug("%s %s failed: %s", self.name, what, code)

    # --- ByteStore --------------------------------------------------------

    def contains(self, keys: Iterable[str]) -> list[bool]:
        keys = list(keys)
        out: list[bool] = []
        for batch in batched(keys, self.config.max_keys_per_call):
            request = KeyBatch(batch).encode()  # a malformed key raises ValueError here
            flags = [False] * len(batch)
            if not self._closed:
                try:
                    reply = self._contains(
                        request, timeout=self.config.timeout_s, metadata=self._metadata
                    )
                    decoded = FlagBatch.decode(reply).flags
                    if len(decoded) == len(batch):
                        flags = decoded
                        self._on_success()
                    else:
                        self._count("corrupt_frames")
                except grpc.RpcError as e:
                    self._on_error("Contains", e)
                except FramingError:
                    self._count("corrupt_frames")
            out.extend(flags)
        return out

    def get_bytes(self, key: str) -> bytes | None:
        return self.get_many([key])[key]

    def get_many(
        self, keys: Iterable[str], timeout_s: float | None = None
    ) -> dict[str, bytes | None]:
        """Fetch several objects; each call of ``max_keys_per_call`` keys has one deadline.

        Returns:
            ``{key: bytes or None}`` for every requested key; objects completed
            before a failure are kept, the rest are misses.
        """
        keys = list(dict.fromkeys(keys))
        found: dict[str, bytes | None] = dict.fromkeys(keys)
        for batch in batched(keys, self.config.max_keys_per_call):
            if not self._closed:
                self._fetch_batch(batch, found, timeout_s or self.config.timeout_s)
        num_hits = sum(v is not None for v in found.values())
        self._count("hits", num_hits)
        self._count("misses", len(found) - num_hits)
        return found

    def _fetch_batch(self, batch: list[str], found: dict[str, bytes | None], timeout_s: float):
        request = KeyBatch(batch).encode()  # a malformed key raises ValueError here
        wanted = set(batch)
        assembler = Reassembler(self.config.max_object_bytes)
        stream = self._fetch(request, timeout=timeout_s, metadata=self._metadata)
        try:
            for frame in stream:
                done = assembler.feed(Chunk.decode(frame))
                if done is None:
                    continue
                key, data = done
                if key not in wanted:
                    raise FramingError(f"server sent unrequested key {key!r}")
                found[key] = data
                if data is not None:
                    self._count("bytes_fetched", len(data))
            self._on_success()
        except grpc.RpcError as e:
            self._on_error("Fetch", e)
        except FramingError as e:
            logger.warning("%s sent a malformed Fetch stream: %s", self.name, e)
            self._count("corrupt_frames")
            stream.cancel()

    def put_bytes(self, key: str, data: bytes | memoryview) -> bool:
        return self.put_many({key: data})[key]

    def put_many(self, items: Mapping[str, bytes | memoryview]) -> dict[str, bool]:
        """Push several objects, grouped so each call stays within the in-flight budget."""
        result = dict.fromkeys(items, False)
        for key in items:
            check_key(key)  # a malformed key raises ValueError before anything is sent
        group: list[tuple[str, memoryview]] = []
        group_bytes = 0
        for key, data in items.items():
            view = memoryview(data).cast("B")
            if group and group_bytes + view.nbytes > self.config.max_inflight_push_bytes:
                self._push_group(group, group_bytes, result)
                group, group_bytes = [], 0
            group.append((key, view))
            group_bytes += view.nbytes
        if group:
            self._push_group(group, group_bytes, result)
        num_ok = sum(result.values())
        self._count("puts_ok", num_ok)
        self._count("puts_failed", len(result) - num_ok)
        return result

    def _push_group(
        self, group: list[tuple[str, memoryview]], num_bytes: int, result: dict[str, bool]
    ):
        if self._closed:
            return
        timeout_s = self.config.timeout_s + num_bytes / self.config.min_push_bytes_per_s
        deadline = time.monotonic() + timeout_s  # one deadline for waiting and sending
        if not self._budget.acquire(num_bytes, timeout_s):
            self._count("timeouts")
            return
        timeout_s = max(deadline - time.monotonic(), 1e-3)
        chunk_bytes = self.config.chunk_bytes

        def frames() -> Iterator[bytes]:
            for key, view in group:
                for chunk in chunk_object(key, view, chunk_bytes):
                    yield chunk.encode()

        try:
            reply = self._push(frames(), timeout=timeout_s, metadata=self._metadata)
            flags = FlagBatch.decode(reply).flags
            if len(flags) != len(group):
                raise FramingError(f"{len(flags)} results for {len(group)} objects")
            for (key, _), ok in zip(group, flags, strict=True):
                result[key] = ok
            self._count("bytes_pushed", num_bytes)
            self._on_success()
        except grpc.RpcError as e:
            self._on_error("Push", e)
        except FramingError:
            self._count("corrupt_frames")
        finally:
            self._budget.release(num_bytes)

    def delete(self, key: str) -> bool:
        request = KeyBatch([key]).encode()  # a malformed key raises ValueError here
        if self._closed:
            return False
        try:
            reply = self._delete(request, timeout=self.config.timeout_s, metadata=self._metadata)
            flags = FlagBatch.decode(reply).flags
            self._on_success()
            return flags == [True]
        except grpc.RpcError as e:
            self._on_error("Delete", e)
        except FramingError:
            self._count("corrupt_frames")
        return False

    def demote(self, keys: Sequence[str]) -> int:
        """Have the peer's store evict ``keys`` before every other object, ``keys[0]`` first
        (a host tier's ``demote``: still readable until evicted): how many it held. A call that
        fails demotes nothing here and counts 0 (NOTE 1): eviction by recency stays."""
        batches = list(batched(list(keys), self.config.max_keys_per_call))
        if self._closed or not batches:
            return 0
        n = 0
        for batch in reversed(batches):  # each batch goes to the head: the first batch goes last
            request = KeyBatch(batch).encode()  # a malformed key raises ValueError here
            try:
                reply = self._demote(request, timeout=self.config.timeout_s, metadata=self._metadata)
                flags = FlagBatch.decode(reply).flags
                self._on_success()
            except grpc.RpcError as e:
                self._on_error("Demote", e)
                continue
            except FramingError:
                self._count("corrupt_frames")
                continue
            if len(flags) != len(batch):
                self._count("corrupt_frames")
                continue
            n += sum(flags)
        self._count("demoted", n)
        return n

    def server_stats(self) -> ServerStats | None:
        """The peer's counters, or None when it cannot be asked."""
        if self._closed:
            return None
        try:
            reply = self._stats(b"", timeout=self.config.timeout_s, metadata=self._metadata)
            self._on_success()
            return ServerStats.decode(reply)
        except grpc.RpcError as e:
            self._on_error("Stats", e)
        except ValueError:
            self._count("corrupt_frames")
        return None
