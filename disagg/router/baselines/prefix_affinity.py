"""Ray Serve PrefixCacheAffinityRouter, re-stated over token blocks.

The original keeps an approximate character-level radix tree of the prompt
*text* it has routed to each replica (its own decisions, not engine events)
and, per request:

    if max(queue_len) - min(queue_len) > imbalanced_threshold:
        power of two choices                                   ("imbalanced")
    elif match_rate = matched_chars / len(text) >= match_rate_threshold (0.1):
        replicas with the deepest match                        ("prefix_match")
    else:
        replicas holding the fewest characters                 ("least_cached")

and within the chosen set draws a power-of-two choice. After routing it
inserts the text for the chosen replica; trees above a size threshold evict
least-recently-used text down to a target.

Approximation used here (token IDs, no text): a "character" is one token
block, the tree path of a prompt is its chain of block digests (equal
digests = equal prefixes, so a digest set per replica *is* a radix tree of
blocks), match rate = matched blocks / prompt blocks, size = blocks held.
When ``request.text`` is present the same code runs on a digest chain over
fixed-size character chunks (``text_chunk_chars``), closer to the original.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from disagg.router.baselines.common import NoFeedback, decision, is_aggregated, pools
from disagg.router.baselines.power_of_two import pow2_pick
from disagg.router.types import RouteDecision, RouteRequest, WorkerState


def text_chain(text: str, chunk_chars: int) -> list[bytes]:
    """Chained digests over full ``chunk_chars`` chunks of the text."""
    h = hashlib.sha256(b"text-root").digest()[:16]
    out = []
    for i in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = hashlib.sha256(h + text[i : i + chunk_chars].encode()).digest()[:16]
        out.append(h)
    return out


class PrefixAffinityRouter(NoFeedback):
    name = "prefix_affinity"

    def __init__(
        self,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
        eviction_threshold_blocks: int = 200_000,
        eviction_target_blocks: int = 160_000,
        text_chunk_chars: int = 64,
        seed: int = 0,
    ):
        if not 0.0 <= match_rate_threshold <= 1.0:
            raise ValueError("match_rate_threshold must be in [0, 1]")
        if eviction_target_blocks > eviction_threshold_blocks:
            raise ValueError("eviction target must not exceed the threshold")
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.eviction_threshold = eviction_threshold_blocks
        self.eviction_target = eviction_target_blocks
        self.text_chunk_chars = text_chunk_chars
        self._rng = random.Random(seed)
        self._bit: dict[str, int] = {}
        self._present: dict[bytes, int] = {}  # digest -> replica bitmask
        self._lru: dict[str, OrderedDict[bytes, None]] = {}  # replica -> digests, oldest first

    def _chain(self, request: RouteRequest) -> list[bytes]:
        if request.text is not None:
            return text_chain(request.text, self.text_chunk_chars)
        return request.block_hashes

    def _bit_of(self, worker_id: str) -> int:
        if worker_id not in self._bit:
            self._bit[worker_id] = len(self._bit)
            self._lru[worker_id] = OrderedDict()
        return self._bit[worker_id]

    def matched_blocks(self, chain: list[bytes], workers: list[WorkerState]) -> dict[str, int]:
        alive = 0
        for w in workers:
            alive |= 1 << self._bit_of(w.worker_id)
        depth = dict.fromkeys((w.worker_id for w in workers), 0)
        for i, h in enumerate(chain):
            alive &= self._present.get(h, 0)
            if not alive:
                break
            for w in workers:
                if alive >> self._bit[w.worker_id] & 1:
                    depth[w.worker_id] = i + 1
        return depth

    def held_blocks(self, worker_id: str) -> int:
        return len(self._lru.get(worker_id, ()))

    def _choose(self, request: RouteRequest, workers: list[WorkerState]) -> tuple[WorkerState, str, int]:
        qs = [w.queue_length for w in workers]
        if max(qs) - min(qs) > self.imbalanced_threshold:
            return pow2_pick(self._rng, workers), "imbalanced", 0
        chain = self._chain(request)
        depth = self.matched_blocks(chain, workers)
        deepest = max(depth.values(), default=0)
        rate = deepest / len(chain) if chain else 0.0
        if deepest > 0 and rate >= self.match_rate_threshold:
            group = [w for w in workers if depth[w.worker_id] == deepest]
            reason = "prefix_match"
        else:
            least = min(self.held_blocks(w.worker_id) for w in workers)
            group = [w for w in workers if self.held_blocks(w.worker_id) == least]
            reason = "least_cached"
        pick = pow2_pick(self._rng, group)
        return pick, reason, depth.get(pick.worker_id, 0) * request.block_size

    def _insert(self, request: RouteRequest, worker_id: str) -> None:
        bit = 1 << self._bit_of(worker_id)
        lru = self._lru[worker_id]
        for h in self._chain(request):
            self._present[h] = self._present.get(h, 0) | bit
            lru[h] = None
            lru.move_to_end(h)
        if len(lru) > self.eviction_threshold:
            while len(lru) > self.eviction_target:
                h, _ = lru.popitem(last=False)
                m = self._present.get(h, 0) & ~bit
                if m:
                    self._present[h] = m
                else:
                    self._present.pop(h, None)

    def route(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        pre, dec = pools(workers)
        pick, reason, predicted = self._choose(request, pre)
        if is_aggregated(workers):
            return decision(request, pick.worker_id, pick.worker_id, True, reason, predicted)
        d = pow2_pick(self._rng, dec).worker_id
        return decision(request, pick.worker_id, d, False, reason, predicted)

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        self._insert(request, decision.prefill_target)
