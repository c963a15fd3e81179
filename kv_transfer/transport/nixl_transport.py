"""Optional NIXL backend: one-sided READs of a peer's registered host memory.

NIXL (over UCX) moves bytes between registered regions without the owner's
CPU touching them; in production it is the GPU-direct path. This module does
the host-DRAM part, which also runs on a CPU-only machine:

    owner                                   reader
    agent.register(buf) -> RegionDescriptor ---- (any side channel) ---->
                                            agent.read(descriptor, into=dst)
                                            (READ: owner's buf -> dst)

A ``RegionDescriptor`` is plain data (agent name, agent metadata, address,
length), so it can travel over the gRPC state service or any other channel.
The owner must keep the buffer alive and registered until readers are done.

Availability is decided at run time: ``is_available()`` imports the NIXL
Python package (``nixl_cu12``, ``nixl_cu13`` or ``nixl``) and creates nothing;
when it is absent, ``unavailable_reason()`` says why and every caller falls
back to the gRPC transport. Nothing here is imported by the rest of
``kv_transfer`` unless asked for.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np

_CANDIDATE_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")


@cache
def _load() -> tuple[ModuleType | None, str | None]:
    errors: list[str] = []
    for name in _CANDIDATE_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # ImportError, or a native library failing to load
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if hasattr(module, "nixl_agent"):
            return module, None
        errors.append(f"{name}: imported but has no nixl_agent")
    return None, "NIXL Python package not usable (" + "; ".join(errors) + ")"


def is_available() -> bool:
    """True when a NIXL package with ``nixl_agent`` imports."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why NIXL cannot be used, or None when it can."""
    return _load()[1]


@dataclass(slots=True)
class RegionDescriptor:
    """What a reader needs to READ one registered host region of a peer."""

    agent_name: str  # NIXL agent owning the region
    agent_metadata: bytes  # owner's serialized agent metadata (taken after registration)
    address: int  # start address of the region in the owner's process
    num_bytes: int  # region length
    device_id: int = 0  # 0 for host DRAM

    def __repr__(self) -> str:  # metadata is a large opaque blob: keep it out of logs
        return (
            f"RegionDescriptor(agent_name={self.agent_name!r}, address=0x{self.address:x}, "
            f"num_bytes={self.num_bytes})"
        )


def _as_uint8(buffer: Any) -> np.ndarray:
    array = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer
    assert array.flags.c_contiguous, "NIXL regions must be contiguous"
    return array.reshape(-1).view(np.uint8)


class NixlAgent:
    """One NIXL agent with host-memory registration and blocking READs.

    NOTES
    1. A registered buffer is referenced by the agent until ``close``, so it
       cannot be freed while a peer may READ it.

    Args:
        name: agent name, unique among the peers that talk to it.
        backends: NIXL backends to create (UCX moves DRAM <-> DRAM).
    """

    def __init__(self, name: str, backends: tuple[str, ...] = ("UCX",)):
        module, reason = _load()
        if module is None:
            raise RuntimeError(reason)
        self.name = name
        self._agent = module.nixl_agent(name, module.nixl_agent_config(backends=list(backends)))
        self._registered: list[tuple[np.ndarray, Any]] = []  # (buffer, registration)
        self._peers: dict[str, str | bytes] = {}  # remote agent name -> handle name

    def register(self, buffer: Any) -> RegionDescriptor:
        """Register a writable host buffer (bytearray, numpy array, ...) for peers to READ."""
        array = _as_uint8(buffer)
        region = (array.ctypes.data, array.nbytes, 0, "")
        registration = self._agent.register_memory([region], "DRAM")
        self._registered.append((array, registration))
        return RegionDescriptor(
            self.name, self._agent.get_agent_metadata(), array.ctypes.data, array.nbytes
        )

    def read(
        self, remote: RegionDescriptor, into: Any, offset: int = 0, timeout_s: float = 5.0
    ) -> bool:
        """READ ``len(into)`` bytes at ``remote.address + offset`` into a local buffer.

        ``into`` is registered on first use. Returns False on a transfer error
        or when ``timeout_s`` passes (the request is then released).
        """
        dst = _as_uint8(into)
        if offset < 0 or offset + dst.nbytes > remote.num_bytes:
            raise ValueError(
                f"read [{offset}, +{dst.nbytes}) outside a {remote.num_bytes}-byte region"
            )
        if not any(a.ctypes.data == dst.ctypes.data for a, _ in self._registered):
            self._registered.append((dst, self._agent.register_memory(
                [(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")))  # fmt: skip
        peer = self._peers.get(remote.agent_name)  # metadata is loaded once per peer
        if peer is None:
            peer = self._agent.add_remote_agent(remote.agent_metadata)
            self._peers[remote.agent_name] = peer
        local = self._agent.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
        far = self._agent.get_xfer_descs(
            [(remote.address + offset, dst.nbytes, remote.device_id)], "DRAM"
        )
        handle = self._agent.initialize_xfer("READ", local, far, peer)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)
            return state == "DONE"
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # a transfer still in progress cannot always be released
                pass

    def close(self) -> None:
        for _, registration in self._registered:
            self._agent.deregister_memory(registration)
        self._registered.clear()
        for peer in self._peers.values():
            self._agent.remove_remote_agent(peer)
        self._peers.clear()
