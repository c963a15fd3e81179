"""Cross-node transport: a node's ByteStore served to peers over gRPC.

``StateServer`` exposes any ``ByteStore`` (normally the node's host tier);
``RemoteStore`` is the peer-side client and is itself a ``ByteStore`` named
``remote:<host:port>``, so a tier stack can put it below its local tiers.

Service ``disagg.kv.v1.StateStore`` (messages are raw bytes; layouts in
``framing``; no protobuf code generation):

    method     kind             request             reply
    Contains   unary-unary      KeyBatch            FlagBatch (present)
    Fetch      unary-stream     KeyBatch            Chunk*  (objects in key order;
                                                             a miss is one miss marker)
    Push       stream-unary     Chunk*              FlagBatch (stored, per object)
    Delete     unary-unary      KeyBatch            FlagBatch (removed)
    Demote     unary-unary      KeyBatch            FlagBatch (held; evicted first from now,
                                                             the first key first)
    Stats      unary-unary      empty               ServerStats (JSON)

Framing: each object travels as chunks of at most ``chunk_bytes`` payload
(default 2 MiB), each chunk a 20-byte header + key + payload; the receiver
reassembles and checks offsets and the final length. Message size limits are
set on both ends to ``max_message_bytes`` (chunk + header + key); a larger
frame fails the call with RESOURCE_EXHAUSTED before anything is stored.

Auth: every call carries ``x-disagg-token: <shared secret>`` in its metadata.
A server interceptor compares it with ``hmac.compare_digest`` before the
handler runs; a missing or wrong token ends the call with UNAUTHENTICATED
without reading the request or touching the store. TLS (and mTLS when a
client CA is configured) is optional and independent of the token.

Failure model (client): every call has a deadline. UNAVAILABLE,
DEADLINE_EXCEEDED, UNAUTHENTICATED, RESOURCE_EXHAUSTED and malformed replies
become misses / False and are counted in ``stats()``; nothing raises, nothing
hangs. Objects that completed before a Fetch failed are still returned.

Config example (YAML)::

    transport:
      server: {address: "0.0.0.0:7070", token: "<shared secret, from the environment>", chunk_bytes: 2097152}
      peers:  [{address: "10.0.0.12:7070", token: "<same secret>", timeout_s: 5.0}]
"""

from __future__ import annotations

from kv_transfer.transport.grpc_client import RemoteStore, RemoteStoreConfig
from kv_transfer.transport.grpc_protocol import (
    SERVICE_NAME,
    TOKEN_METADATA_KEY,
    TlsClientConfig,
    TlsServerConfig,
)
from kv_transfer.transport.grpc_server import StateServer, StateServerConfig

__all__ = [
    "SERVICE_NAME",
    "TOKEN_METADATA_KEY",
    "RemoteStore",
    "RemoteStoreConfig",
    "StateServer",
    "StateServerConfig",
    "TlsClientConfig",
    "TlsServerConfig",
]
