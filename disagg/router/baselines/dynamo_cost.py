"""Dynamo-style KV-aware cost router (lowest cost wins).

    new_blocks     = ceil(prompt_len / block_size)
    overlap_credit = sum over the worker's consecutive cached leading blocks of
                     credit[fastest tier]   (device 1.0, host 0.75, disk 0.25, remote 0.25)
    active_prefill = queued_prefill_tokens / block_size
    decode_blocks  = (running_decode_tokens + inbound_decode_tokens) / block_size
    cost_w = prefill_load_scale * max(active_prefill + new_blocks - overlap_credit, 0) + decode_blocks

Ties go to the earlier worker. The overlap comes from the same prefix index
our router reads (block events), but counts MLA blocks only: like the
original it does not know that a hybrid model also needs a KDA checkpoint
at the resume point, so it can prefer a worker whose blocks it cannot use.
With P/D pools the prefill worker is the lowest-cost prefill worker and the
decode worker the one with the fewest decode blocks. Those count the
requests a decode worker took that still prefill in the pool (inbound), as
the original's active-sequence books count a request from its routing on.
"""

from __future__ import annotations

import math

from disagg.router.baselines.common import NoFeedback, decision, is_aggregated, pools
from disagg.router.index import PrefixIndex
from disagg.router.types import RouteDecision, RouteRequest, WorkerState

DEFAULT_CREDIT = (1.0, 0.75, 0.25, 0.25)  # device, host, disk, remote


def _decode_tokens(w: WorkerState) -> int:
    return w.running_decode_tokens + w.inbound_decode_tokens


class DynamoCostRouter(NoFeedback):
    name = "dynamo_cost"

    def __init__(
        self,
        index: PrefixIndex,
        prefill_load_scale: float = 1.0,
        tier_credit: tuple[float, float, float, float] = DEFAULT_CREDIT,
    ):
        if prefill_load_scale < 0:
            raise ValueError("prefill_load_scale must be >= 0")
        self.index = index
        self.prefill_load_scale = prefill_load_scale
        self.tier_credit = tier_credit

    def costs(self, request: RouteRequest, workers: list[WorkerState]) -> dict[str, float]:
        bs = request.block_size
        for w in workers:
            self.index.add_worker(w.worker_id, w.node_id)
        overlap = self.index.block_overlap(request, [w.worker_id for w in workers])
        new_blocks = math.ceil(request.prompt_len / bs)
        out = {}
        for w in workers:
            credit = sum(c * n for c, n in zip(self.tier_credit, overlap[w.worker_id], strict=True))
            prefill = max(w.queued_prefill_tokens / bs + new_blocks - credit, 0.0)
            out[w.worker_id] = self.prefill_load_scale * prefill + _decode_tokens(w) / bs
        return out

    def route(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        pre, dec = pools(workers)
        costs = self.costs(request, pre)
        best = min(pre, key=lambda w: costs[w.worker_id])  # min() keeps the first of ties
        overlap = self.index.block_overlap(request, [best.worker_id])[best.worker_id]
        predicted = min(sum(overlap) * request.block_size, request.prompt_len)
        if is_aggregated(workers):
            return decision(request, best.worker_id, best.worker_id, True, "min_cost", predicted, costs)
        d = min(dec, key=_decode_tokens).worker_id
        return decision(request, best.worker_id, d, False, "min_cost", predicted, costs)
