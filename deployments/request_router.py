"""Serve request router: session and prefix affinity with load fallback.

Placeholder policy until the state-aware policy core is wired in: rank the
replicas by rendezvous (highest-random-weight) hashing of the request's
affinity key (session id, else the digest of the prompt's first block), so the
turns of a session land where its state is; the other replicas follow, least
loaded first, so Serve falls back to them when the first is full or dead.
Requests without ``GenerateParams`` (stats, health) go anywhere.
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import FIFOMixin, RequestRouter

from disagg.messages import GenerateParams


def affinity_key(params: GenerateParams, block_size: int = 64) -> str:
    if params.session_id:
        return f"s:{params.cache_salt}:{params.session_id}"
    head = params.prompt_token_ids[:block_size]
    return "p:" + hashlib.sha256(f"{params.cache_salt}|{head}".encode()).hexdigest()


def _weight(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}|{replica_id}".encode()).digest()[:8], "big")


class AffinityRequestRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        params = None
        if pending_request is not None and pending_request.args:
            params = pending_request.args[0]
        if not isinstance(params, GenerateParams) or len(candidate_replicas) <= 1:
            return [candidate_replicas]
        key = affinity_key(params)
        ranked = sorted(candidate_replicas, key=lambda r: _weight(key, r.replica_id.unique_id), reverse=True)
        rest = sorted(ranked[1:], key=lambda r: (r.routing_stats or {}).get("inflight", 0))
        return [[ranked[0]], rest]
