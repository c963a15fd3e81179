"""Moving encoded state between nodes.

Backends, registered in ``TRANSPORTS`` (name -> availability check):

    grpc   StateServer / RemoteStore, always available (see ``grpc_transport``)
    nixl   NixlAgent one-sided READs of registered host memory, when a NIXL
           package imports (see ``nixl_transport``)

Same-node sharing goes through the host tier's shared memory, not through a
transport.
"""

from __future__ import annotations

from collections.abc import Callable

from kv_transfer.transport import nixl_transport
from kv_transfer.transport.grpc_transport import (
    RemoteStore,
    RemoteStoreConfig,
    StateServer,
    StateServerConfig,
    TlsClientConfig,
    TlsServerConfig,
)

TRANSPORTS: dict[str, Callable[[], bool]] = {
    "grpc": lambda: True,
    "nixl": nixl_transport.is_available,
}


def available_transports() -> list[str]:
    """Names of the transports usable in this process, in preference order of the table."""
    return [name for name, available in TRANSPORTS.items() if available()]


__all__ = [
    "TRANSPORTS",
    "RemoteStore",
    "RemoteStoreConfig",
    "StateServer",
    "StateServerConfig",
    "TlsClientConfig",
    "TlsServerConfig",
    "available_transports",
]
