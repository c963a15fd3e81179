"""The server side of the state service: ``StateServer`` over any ``ByteStore``.

See ``grpc_transport`` for the protocol (methods, framing, auth).
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from kv_transfer.transport.framing import (
    Chunk,
    FlagBatch,
    FramingError,
    KeyBatch,
    Reassembler,
    ServerStats,
    chunk_object,
    miss_chunk,
)
from kv_transfer.transport.grpc_protocol import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    SERVICE_NAME,
    TOKEN_METADATA_KEY,
    TlsServerConfig,
    check_sizes,
    check_token,
)

if TYPE_CHECKING:
    from kv_transfer.tiers.base import ByteStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StateServerConfig:
    """How a node serves its store to peers."""

    token: str  # shared secret every call must present
    address: str = "127.0.0.1:0"  # bind "host:port"; port 0 picks a free port
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # Fetch payload bytes per frame
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # gRPC send/receive limit
    max_object_bytes: int = 1 << 30  # largest object accepted by Push
    max_keys_per_call: int = 65536  # largest KeyBatch accepted
    max_workers: int = 8  # handler threads
    max_concurrent_rpcs: int = 64  # beyond this, calls fail with RESOURCE_EXHAUSTED
    tls: TlsServerConfig | None = None  # None = plaintext (token still required)

    def __post_init__(self) -> None:
        check_token(self.token)
        check_sizes(self.chunk_bytes, self.max_message_bytes)
        if ":" not in self.address:
            raise ValueError(f"address must be host:port, got {self.address!r}")
        if self.max_workers <= 0 or self.max_concurrent_rpcs <= 0:
            raise ValueError("max_workers and max_concurrent_rpcs must be positive")
        if self.max_object_bytes <= 0 or self.max_keys_per_call <= 0:
            raise ValueError("max_object_bytes and max_keys_per_call must be positive")


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the shared secret before their handler runs."""

    def __init__(self, token: str, on_reject: Callable[[str], None]):
        self._token = token.encode()
        self._on_reject = on_reject

    def intercept_service(self, continuation, handler_call_details):
        supplied = b""
        for item in handler_call_details.invocation_metadata or ():
            if item.key == TOKEN_METADATA_KEY:
                value = item.value
                supplied = value.encode() if isinstance(value, str) else bytes(value)
        if supplied and hmac.compare_digest(supplied, self._token):
            return continuation(handler_call_details)
        self._on_reject(handler_call_details.method)
        handler = continuation(handler_call_details)
        return None if handler is None else _refusing_handler(handler)


def _refuse(request_or_iterator, context: grpc.ServicerContext):
    # The request (iterator) is never read: nothing is parsed, stored or fetched.
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    return grpc.stream_stream_rpc_method_handler(_refuse)


class _StateServicer:
    """Handlers of the StateStore service over one ByteStore."""

    def __init__(self, store: ByteStore, config: StateServerConfig):
        self.store = store
        self.config = config
        self.stats = ServerStats(store_name=store.name)
        self._lock = threading.Lock()

    def count(self, field_name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, field_name, getattr(self.stats, field_name) + n)

    def handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Contains": grpc.unary_unary_rpc_method_handler(self.contains),
                "Fetch": grpc.unary_stream_rpc_method_handler(self.fetch),
                "Push": grpc.stream_unary_rpc_method_handler(self.push),
                "Delete": grpc.unary_unary_rpc_method_handler(self.delete),
                "Demote": grpc.unary_unary_rpc_method_handler(self.demote),
                "Stats": grpc.unary_unary_rpc_method_handler(self.get_stats),
            },
        )

    def _keys(self, request: bytes, context: grpc.ServicerContext) -> list[str]:
        try:
            keys = KeyBatch.decode(request).keys
        except FramingError as e:
            self.count("num_bad_requests")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad key batch: {e}")
        if len(keys) > self.config.max_keys_per_call:
            self.count("num_bad_requests")
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(keys)} keys > max_keys_per_call {self.config.max_keys_per_call}",
            )
        return keys

    def contains(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        keys = self._keys(request, context)
        self.count("num_contains_keys", len(keys))
        return FlagBatch(list(self.store.contains(keys))).encode()

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        keys = self._keys(request, context)
        for key in keys:
            if not context.is_active():
                return
            try:
                data = self.store.get_bytes(key)
            except Exception:
                logger.exception("store %s failed to read %s", self.store.name, key)
                self.count("num_store_errors")
                data = None
            if data is None:
                self.count("num_fetch_misses")
                yield miss_chunk(key).encode()
                continue
            self.count("num_fetch_hits")
            for chunk in chunk_object(key, data, self.config.chunk_bytes):
                yield chunk.encode()
            self.count("num_bytes_sent", len(memoryview(data).cast("B")))

    def push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        assembler = Reassembler(self.config.max_object_bytes)
        stored: list[bool] = []
        try:
            for frame in request_iterator:
                chunk = Chunk.decode(frame)
                if not chunk.found:
                    raise FramingError("Push carries objects, not miss markers")
                done = assembler.feed(chunk)
                if done is None:
                    continue
                key, data = done
                assert data is not None, "a found object reassembles to bytes"
                stored.append(self._put(key, data))
            if assembler.pending_key is not None:
                raise FramingError(f"stream ended inside object {assembler.pending_key!r}")
        except FramingError as e:
            self.count("num_bad_requests")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad push stream: {e}")
        return FlagBatch(stored).encode()

    def _put(self, key: str, data: bytes) -> bool:
        try:
            ok = bool(self.store.put_bytes(key, data))
        except Exception:
            logger.exception("store %s failed to write %s", self.store.name, key)
            self.count("num_store_errors")
            ok = False
        self.count("num_push_stored" if ok else "num_push_refused")
        if ok:
            self.count("num_bytes_received", len(data))
        return ok

    def delete(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        removed = [bool(self.store.delete(k)) for k in self._keys(request, context)]
        self.count("num_deleted", sum(removed))
        return FlagBatch(removed).encode()

    def demote(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The store evicts these keys before every other object, the first key first (a host
        tier's ``demote``; a store without an eviction order keeps its own): one flag per key,
        held and demoted."""
        keys = self._keys(request, context)
        demote = getattr(self.store, "demote", None)
        flags = [False] * len(keys)
        if demote is not None:
            try:  # one key at a time, last first: each goes to the head, so the first ends up first
                for i in range(len(keys) - 1, -1, -1):
                    flags[i] = bool(demote([keys[i]]))
            except Exception:
                logger.exception("store %s failed to demote", self.store.name)
                self.count("num_store_errors")
        self.count("num_demoted", sum(flags))
        return FlagBatch(flags).encode()

    def get_stats(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            return self.stats.encode()


class StateServer:
    """Serves one ``ByteStore`` to authenticated peers.

    NOTES
    1. No handler runs, and the store is neither read nor written, for a call
       whose token does not match.
    2. Push stores an object only once all of its bytes arrived and their
       length equals the announced total; a broken stream stores nothing of
       the object in progress.

    Args:
        store: the tier to expose (any ``ByteStore``).
        config: bind address, token, limits and TLS.
    """

    def __init__(self, store: ByteStore, config: StateServerConfig):
        self.config = config
        self._servicer = _StateServicer(store, config)
        self._server: grpc.Server | None = None
        self.port: int | None = None  # bound port, known after start()

    @property
    def address(self) -> str:
        """``host:port`` with the bound port (after ``start``)."""
        assert self.port is not None, "start() the server first"
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def stats(self) -> ServerStats:
        with self._servicer._lock:
            return ServerStats.decode(self._servicer.stats.encode())

    def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        assert self._server is None, "server already started"
        cfg = self.config
        server = grpc.server(
            ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="kv-state"),
            handlers=[self._servicer.handlers()],
            interceptors=[
                _TokenInterceptor(cfg.token, lambda m: self._servicer.count("num_auth_failures"))
            ],
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
        )
        try:
            if cfg.tls is None:
                port = server.add_insecure_port(cfg.address)
            else:
                creds = grpc.ssl_server_credentials(
                    [(cfg.tls.private_key, cfg.tls.cert_chain)],
                    root_certificates=cfg.tls.client_ca,
                    require_client_auth=cfg.tls.client_ca is not None,
                )
                port = server.add_secure_port(cfg.address, creds)
        except RuntimeError as e:
            raise OSError(f"cannot bind {cfg.address}: {e}") from e
        if not port:
            raise OSError(f"cannot bind {cfg.address}")
        server.start()
        self._server, self.port = server, port
        logger.info("state server for %s on %s", self._servicer.store.name, self.address)
        return port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting calls; in-flight calls get ``grace`` seconds to finish."""
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout``); True if it stopped."""
        return self._server is None or not self._server.wait_for_termination(timeout)

    def __enter__(self) -> StateServer:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(0)
