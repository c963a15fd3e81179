"""Small builders shared by the router tests."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from disagg.router.types import RouteRequest, WorkerState


def chain(n: int, seed: str = "p") -> list[bytes]:
    h = hashlib.sha256(seed.encode()).digest()[:16]
    out = []
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()[:16]
        out.append(h)
    return out


@dataclass(slots=True)
class Ev:
    kind: str
    key: str
    tier: str
    worker_id: str
    object_kind: str = ""
    position: int = 0
    parent_digest: bytes | None = None
    nbytes: int = 0
    timestamp: float = 0.0
    from_tier: str | None = None


def store(index, kind: str, digest: bytes, tier: str, worker: str, op: str = "stored") -> None:
    index.apply(Ev(op, f"{kind}:{digest.hex()}", tier, worker, kind))


def req(hashes: list[bytes], prompt_len: int | None = None, bs: int = 4, sid: str = "s", rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, sid, hashes, prompt_len if prompt_len is not None else len(hashes) * bs + 1, bs)


def workers(n: int, per_node: int = 1, role: str = "both", **kw) -> list[WorkerState]:
    return [WorkerState(f"w{i}", role, f"n{i // per_node}", **kw) for i in range(n)]
