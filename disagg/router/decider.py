"""Prefill/decode decider: disaggregate, or prefill on the decode worker.

    suffix = prompt_len - resumable(decode_worker)       tokens left to compute
    w      = 1 + local_harm_weight * B_d                  B_d: the decode worker's running decodes
    w_c    = 1 + local_harm_weight * C_d                  C_d: those and the requests routed to it
                                                          and not finished (see "local_idle")
    local  if suffix * w <= local_prefill_max_tokens      ("local_short_suffix")
    local  if min_{p in prefill pool} q_p >= prefill_busy_tokens
           and suffix * w_c <= busy_local_max_tokens       ("local_prefill_busy")
    local  if u_p = prompt_len - resumable(p) is given for the pool,
           suffix < min_p u_p (the decode worker resumes more than any prefill worker)
           and suffix * w_c <= min_p (q_p + u_p)                        ("local_state")
    local  if u_p is given, C_d = 0 (C_d: decodes running on the decode worker or
           routed to it and not finished), suffix <= min_p u_p
           and suffix * local_idle_margin <= min_p (q_p + u_p)          ("local_idle")
    local  if u_p is given, the request is its session's first turn, nothing runs or
           is queued on the decode worker (B_d = 0, Q_d = 0), min_p q_p >= prefill_busy_tokens
           and suffix * (local_idle_margin + C_d) <= min_p (q_p + u_p)  ("local_burst")
    else   disaggregate                                   ("disagg")

A short suffix costs less to compute inside the decode batch than to ship
through a prefill worker (an extra hop and a state transfer), but every
decode running there waits for it too: the suffix counts once per waiting
sequence, weighted (w). A saturated prefill pool makes local prefill the
faster path for medium suffixes too, weighted the same way (w_c): an 8K
suffix prefilled beside running decodes stalls each of them a third of a
second, which the P90 ITL shows. (With the suffix alone, on held-out
agentic shapes with a saturated 4:12 pool, the requests around our P90 ITL
spent 0.30 ms per token stalled behind such prefills, and P90 interactivity
trailed the baselines by up to 3.5%; weighted, 0.13 ms, and TTFT P90 went
from x0.91 to x1.10 of the best baseline on the issue's shape, because the
pool, less crowded by medium suffixes, is no worse for them than a stalled
batch: docs/router.md, "Round 9".)

"local_state" is a cost comparison in tokens of prefill work: through the
pool, the request waits for the least loaded prefill worker's queue and then
computes what that worker cannot resume; locally it computes only the suffix,
but each of the decode worker's B_d running decodes waits for those tokens
too (the decode time a local prefill steals, as in the decode scorer), and
so does each decode on its way there: a disaggregated request routed to
that worker, still in the pool, that arrives while the local prefill runs
waits for the step to end and then decodes beside it. The weight counts
C_d, those and the running ones. (With B_d alone, on the router suite's
``long_agentic/64/pd`` at weight 4 the requests at or past the P90 ITL
averaged 11.30 ms per token, 1.64 of it waiting at join and 1.20 stalled
behind local prefills; with C_d, 9.63, 0.35 and 0.79:
``benchmarks/pd_itl.py``.)

It fires only where the decode worker can resume more than the pool: with P/D
pools on separate nodes the decode workers' tiers hold the sessions they
decode, and the prefill pool's tiers, a quarter of the cluster, cannot hold
every live session (docs/router.md, "Router suite"). Without the pool's
u_p (a pool whose cache is not known, e.g. before its replicas report) the
rule is off.

"local_idle" spreads a burst the pool cannot absorb: an idle decode worker
(nothing decoding there, nothing on its way) prefills at no decode's expense
and hands nothing off; it takes the request when the pool's queue would at
least multiply the time to first token by ``local_idle_margin``. Only then:
a turn prefilled on the decode side leaves its state there and not in the
pool, whose next disaggregated turn of that session recomputes it (on
``deep_context/64/pd`` of the router suite a margin of 2 left hit/bound at
0.88, against 0.96 at 4).
"coming" counts the requests the router sent to the decode worker and that
have not finished (a disaggregated one is still in the pool): the running
batch alone calls a worker idle that is about to receive decodes, which a
local prefill would then stall. Serving's decode-side flow counts the same:
the requests in its flow and not finished, the asking one aside.

"local_burst" lets idle decode workers take a saturated pool's new sessions
when "local_idle" cannot: in a burst of first turns on a few big shared
prompts (a product's agent prompt, a document), the decode workers are cold
(their suffix is the whole prompt, more than the pool's least uncached) and
each already has decodes on their way from the pool. A first turn has no
state of its own in the pool to lose; the decode worker computes the shared
prompt again, on capacity that would otherwise idle. A request that names no
session counts as a first turn (the router cannot tell; traces in Mooncake's
format name none), so a resent conversation may be recomputed there: the
saturated pool, the idle worker and the margin bound when. Each decode on its way
there may arrive while it prefills and wait, so each raises the bar by one
suffix (C_d); a worker already prefilling or decoding is not taken (Q_d, B_d).
On the Mooncake-format trace of such a burst (four 24K system prompts, four
prefill workers) TTFT P90 falls from 1.38 s to 0.09 s. Without Q_d, local
prefills stacked on one decode worker at a closed loop's start, and the
decodes behind them lost 7% of P90 interactivity (docs/router.md, "Round 27").

The same decider decides in serving (``disagg.flow``, fed by the Serve
adapter's view of the prefill pool: its effective loads and each replica's
u_p from the adapter's prefix index) and in the simulator (through
``StateAwareRouter``). Its defaults are set once, in ``disagg.config``
(``router.local_prefill_max_tokens`` and friends).

Config example (YAML, the router policy's ``decider`` key)::

    decider: {local_prefill_max_tokens: 256, prefill_busy_tokens: 65536,
              busy_local_max_tokens: 8192, local_harm_weight: 16, local_idle_margin: 4}
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagg.config import (
    BUSY_LOCAL_MAX_TOKENS,
    LOCAL_HARM_WEIGHT,
    LOCAL_IDLE_MARGIN,
    LOCAL_PREFILL_MAX_TOKENS,
    PREFILL_BUSY_TOKENS,
)


@dataclass(slots=True)
class DeciderConfig:
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS  # suffixes up to this prefill locally
    prefill_busy_tokens: float = PREFILL_BUSY_TOKENS  # least-loaded prefill queue that counts as busy
    busy_local_max_tokens: int = BUSY_LOCAL_MAX_TOKENS  # local prefill limit while the pool is busy
    local_harm_weight: float = LOCAL_HARM_WEIGHT  # local rules: weight of each running decode's wait
    local_idle_margin: float = LOCAL_IDLE_MARGIN  # "local_idle": pool cost / local suffix at least (0: off)

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens < 0 or self.busy_local_max_tokens < 0:
            raise ValueError("local prefill limits must be >= 0")
        if self.prefill_busy_tokens <= 0:
            raise ValueError("prefill_busy_tokens must be positive")
        if not self.local_harm_weight >= 0:
            raise ValueError("local_harm_weight must be >= 0")
        if not self.local_idle_margin >= 0:
            raise ValueError("local_idle_margin must be >= 0")


@dataclass(frozen=True, slots=True)
class PDDecision:
    disaggregate: bool  # True: run prefill on a prefill worker
    reason: str  # "disagg" | "local_short_suffix" | "local_prefill_busy" | "local_state" | "local_idle"
    #              | "local_burst" | "local_no_prefill_pool"


class PDDecider:
    def __init__(self, config: DeciderConfig | None = None, **params: object):
        self.config = config or DeciderConfig(**params)  # type: ignore[arg-type]

    def short_suffix(self, suffix, batch):
        """Rule "local_short_suffix": whether a suffix this long is prefilled on a decode worker
        running ``batch`` (>= 0) decodes. Floats, or numpy arrays over decode-worker candidates (the
        decode scorer's harm: ``disagg.router.scorers.decode``). It is the one local rule decided
        from the decode worker alone: the harm's mask where the prefill pool's view is not known
        (``local_mask`` where it is)."""
        cfg = self.config
        return suffix * (1.0 + cfg.local_harm_weight * batch) <= cfg.local_prefill_max_tokens

    def local_mask(self, suffix, batch, queued, prefill_loads: list[float], pool_uncached: list[float],
                   first_turn: bool):
        """Every local rule of ``decide`` at once, over decode-worker candidates (numpy arrays of
        their suffixes, running decodes and queued prefill tokens; the running decodes stand for
        C_d too): where the decider would prefill the request on that worker, given the prefill
        pool's view (the decode scorer's harm mask where that view is known: ``harm_pool_view``)."""
        cfg = self.config
        batch = np.maximum(batch, 0.0)
        local = self.short_suffix(suffix, batch)
        stalled = suffix * (1.0 + cfg.local_harm_weight * batch)
        if min(prefill_loads) >= cfg.prefill_busy_tokens:
            local = local | (stalled <= cfg.busy_local_max_tokens)
        work = min(q + u for q, u in zip(prefill_loads, pool_uncached, strict=True))
        least = min(pool_uncached)
        local = local | ((suffix < least) & (stalled <= work))
        margin = cfg.local_idle_margin
        if margin > 0:
            local = local | ((batch <= 0) & (suffix <= least) & (suffix * margin <= work))
            if first_turn and min(prefill_loads) >= cfg.prefill_busy_tokens:
                local = local | ((batch <= 0) & (queued <= 0) & (suffix * margin <= work))
        return local

    def decide(self, suffix_tokens: int, prefill_loads: list[float], pool_uncached: list[float] | None = None,
               decode_batch: float = 0.0, decode_coming: float | None = None, first_turn: bool = False,
               decode_queued: float = 0.0) -> PDDecision:
        """Args: uncached suffix at the decode worker; effective queued prefill per prefill worker;
        per prefill worker (aligned with the loads) the prompt tokens it could not resume (None:
        unknown, the "local_state", "local_idle" and "local_burst" rules are off); the decode worker's
        running decodes (serving: every request streaming there, prefilling ones included); those and
        the requests on their way to it (None: the running ones); whether the request is its session's
        first turn; the prefill tokens queued on the decode worker."""
        cfg = self.config
        if not prefill_loads:
            return PDDecision(False, "local_no_prefill_pool")
        if self.short_suffix(suffix_tokens, max(decode_batch, 0.0)):
            return PDDecision(False, "local_short_suffix")
        coming = decode_batch if decode_coming is None else max(decode_coming, decode_batch)
        stalled = suffix_tokens * (1.0 + cfg.local_harm_weight * max(coming, 0.0))
        if min(prefill_loads) >= cfg.prefill_busy_tokens and stalled <= cfg.busy_local_max_tokens:
            return PDDecision(False, "local_prefill_busy")
        if pool_uncached:
            work = min(q + u for q, u in zip(prefill_loads, pool_uncached, strict=True))
            least = min(pool_uncached)
            if suffix_tokens < least and stalled <= work:
                return PDDecision(False, "local_state")
            margin = cfg.local_idle_margin
            if margin > 0 and coming <= 0 and suffix_tokens <= least and suffix_tokens * margin <= work:
                return PDDecision(False, "local_idle")
            if (first_turn and margin > 0 and decode_batch <= 0 and decode_queued <= 0
                    and min(prefill_loads) >= cfg.prefill_busy_tokens
                    and suffix_tokens * (margin + max(coming, 0.0)) <= work):
                return PDDecision(False, "local_burst")
        return PDDecision(True, "disagg")
