"""Names, limits and TLS settings shared by the gRPC state server and client.

See ``grpc_transport`` for the protocol (methods, framing, auth).
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.transport.framing import frame_overhead_bytes

SERVICE_NAME = "disagg.kv.v1.StateStore"
TOKEN_METADATA_KEY = "x-disagg-token"
MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 2 * MiB
DEFAULT_MAX_MESSAGE_BYTES = 4 * MiB + frame_overhead_bytes()


def method_path(name: str) -> str:
    return f"/{SERVICE_NAME}/{name}"


def check_token(token: str) -> None:
    if not token:
        raise ValueError("a non-empty shared-secret token is required")
    if not token.isascii() or not token.isprintable():
        raise ValueError("the token must be printable ASCII (it travels as gRPC metadata)")


def check_sizes(chunk_bytes: int, max_message_bytes: int) -> None:
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if chunk_bytes + frame_overhead_bytes() > max_message_bytes:
        raise ValueError(
            f"chunk_bytes {chunk_bytes} + frame overhead {frame_overhead_bytes()} "
            f"exceeds max_message_bytes {max_message_bytes}"
        )


@dataclass(slots=True)
class TlsServerConfig:
    """PEM material for a TLS server; mTLS when ``client_ca`` is set."""

    cert_chain: bytes  # server certificate chain (PEM)
    private_key: bytes  # server private key (PEM)
    client_ca: bytes | None = None  # CA that client certificates must chain to (mTLS)


@dataclass(slots=True)
class TlsClientConfig:
    """PEM material for a TLS client."""

    root_ca: bytes  # CA the server certificate must chain to (PEM)
    cert_chain: bytes | None = None  # client certificate for mTLS (PEM)
    private_key: bytes | None = None  # client private key for mTLS (PEM)
    server_name: str | None = None  # expected name in the server cert, if not the host

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("mTLS needs both cert_chain and private_key")
