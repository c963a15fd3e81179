"""Load scorer: prefer workers with less queued prefill, decode, cache fill and sessions.

    q_n  = q_w / max(max_v q_v, q_floor)          queued prefill tokens (effective)
    d_n  = d_w / max(max_v d_v, d_floor)          context tokens of running and inbound decodes
    r_n  = r_w / max(max_v r_v, r_floor)          decode requests running and inbound
    s_n  = s_w / max(max_v s_v, s_floor)          active sessions placed here
    k_n  = k_w / max(max_v k_v, k_floor)          context tokens of those sessions
    a_n  = a_w / max(max_v a_v, a_floor)          time-averaged queued prefill
    score_w = 1 - (a * q_n + b * d_n + h * r_n + c * util_w + e * s_n + f * k_n + g * a_n)
                  / (a + b + h + c + e + f + g)                                             in [0, 1]

The floors keep tiny absolute differences (a few hundred tokens) from
looking like a 100% imbalance when the cluster is idle. The loads are the
router's *effective* loads (``disagg.router.loads``): live stats plus its own
in-flight predictions, so the scorer reacts to a burst before the next
stats report. The time-averaged queue (g) separates workers that are all
idle right now by how much prefill they have carried lately.

The decode requests (h; "inbound": prefilling in the pool for w or handing
off to it, P/D) are the batch a request joins, counted as sequences: each
one slows every step by its own per-sequence cost whatever its context,
which the decode tokens (b) do not see. A worker decoding one long context
and one decoding three short ones can carry the same d_w; the second's
steps are slower. Normalized by the busiest worker's count, one decode
more is a large step where the decode side is lightly loaded, which is
where a request's co-runners decide its inter-token latency
(docs/router.md, "Round 28").

``requests_max_prompt_share`` limits the term to prompts up to that share of
the smallest device among the candidates (``WorkerState.device_tokens``;
where none reports one, the term stays out), ``requests_max_prompt_tokens``
to a token count: past the bound the scorer is the one without h, its other
weights as they are without it. In aggregated placement a long context that
leaves its worker for a count of co-runners leaves a second copy on a
device and pushes other sessions' state out; what that copy takes of a
device decides, not its length (profile "both": an eighth; docs/router.md,
"Round 29").

Config example (YAML)::

    load: {prefill_weight: 1.0, decode_weight: 0.5, requests_weight: 0.0, cache_weight: 0.2,
           session_weight: 0.5, session_tokens_weight: 0.0, queue_avg_weight: 1.0,
           prefill_floor_tokens: 16384, decode_floor_tokens: 262144, requests_floor: 1,
           requests_max_prompt_tokens: .inf, requests_max_prompt_share: .inf,
           session_floor: 4, session_tokens_floor: 65536, queue_avg_floor_tokens: 1024}
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from disagg.router.context import LOAD_ROW, RoutingContext
from disagg.router.scorers.base import ArrayScorer
from disagg.router.types import WorkerState


@dataclass(slots=True)
class LoadScorerConfig:
    prefill_weight: float = 1.0  # a: queued prefill tokens
    decode_weight: float = 0.5  # b: context tokens of running and inbound decodes
    requests_weight: float = 0.0  # h: decode requests running and inbound
    cache_weight: float = 0.2  # c: device cache utilization
    session_weight: float = 0.5  # e: active sessions
    session_tokens_weight: float = 0.0  # f: context tokens of active sessions
    queue_avg_weight: float = 0.0  # g: time-averaged queued prefill tokens
    prefill_floor_tokens: float = 16384.0  # q_floor
    decode_floor_tokens: float = 262144.0  # d_floor
    requests_floor: float = 1.0  # r_floor
    requests_max_prompt_tokens: float = float("inf")  # h applies to prompts up to this many tokens
    requests_max_prompt_share: float = float("inf")  # ... and up to this share of the candidates' devices
    session_floor: float = 4.0  # s_floor
    session_tokens_floor: float = 65536.0  # k_floor
    queue_avg_floor_tokens: float = 1024.0  # a_floor

    def __post_init__(self) -> None:
        ws = self.weights()
        if min(ws) < 0 or sum(ws) <= 0:
            raise ValueError("load weights must be >= 0 and not all zero")
        floors = (self.prefill_floor_tokens, self.decode_floor_tokens, self.requests_floor, self.session_floor,
                  self.session_tokens_floor, self.queue_avg_floor_tokens)
        if min(floors) <= 0:
            raise ValueError("load floors must be positive")
        if min(self.requests_max_prompt_tokens, self.requests_max_prompt_share) < 0:
            raise ValueError("requests_max_prompt_tokens and requests_max_prompt_share must be >= 0")

    def weights(self) -> tuple[float, ...]:
        return (self.prefill_weight, self.decode_weight, self.requests_weight, self.cache_weight,
                self.session_weight, self.session_tokens_weight, self.queue_avg_weight)


_REQUESTS = LOAD_ROW["decode_requests"]
_INBOUND = LOAD_ROW["inbound_decodes"]


class LoadScorer(ArrayScorer):
    name = "load"

    def __init__(self, config: LoadScorerConfig | None = None, **params: object):
        self.config = cfg = config or LoadScorerConfig(**params)  # type: ignore[arg-type]
        terms = [  # (load row, weight, floor) of the max-normalized terms with a weight
            (LOAD_ROW["prefill_tokens"], cfg.prefill_weight, cfg.prefill_floor_tokens),
            (LOAD_ROW["decode_tokens"], cfg.decode_weight, cfg.decode_floor_tokens),
            (_REQUESTS, cfg.requests_weight, cfg.requests_floor),  # plus the inbound decodes (score_array)
            (LOAD_ROW["active_sessions"], cfg.session_weight, cfg.session_floor),
            (LOAD_ROW["session_tokens"], cfg.session_tokens_weight, cfg.session_tokens_floor),
            (LOAD_ROW["queue_avg"], cfg.queue_avg_weight, cfg.queue_avg_floor_tokens),
        ]
        terms = [t for t in terms if t[1] > 0]
        total = sum(cfg.weights())
        self._rows = np.array([t[0] for t in terms], np.intp)  # an index array: no list conversion per call
        self._requests = next((i for i, t in enumerate(terms) if t[0] == _REQUESTS), None)  # its term, if weighed
        self._weights = np.array([t[1] for t in terms]) / total
        self._floors = np.array([t[2] for t in terms])
        self._cache_weight = cfg.cache_weight / total
        self._max_prompt = cfg.requests_max_prompt_tokens
        self._max_share = cfg.requests_max_prompt_share
        # past the bound: the scorer without h (None where h is its only weight: no pressure there)
        self._bounded = self._requests is not None and min(self._max_prompt, self._max_share) < float("inf")
        self._without = LoadScorer(replace(cfg, requests_weight=0.0)) \
            if self._bounded and total > cfg.requests_weight else None

    def score_array(self, ctx: RoutingContext, workers: list[WorkerState]) -> np.ndarray:
        if self._bounded and self._past_bound(ctx.request.prompt_len, workers):
            return self._without.score_array(ctx, workers) if self._without else np.ones(len(workers))
        x = ctx.view(workers).loads
        terms = x[self._rows]  # a copy
        if self._requests is not None:
            terms[self._requests] += x[_INBOUND]
        pressure = (self._weights / np.maximum(np.maximum.reduce(terms, axis=1), self._floors)) @ terms
        if self._cache_weight:
            pressure += self._cache_weight * np.minimum(np.maximum(x[LOAD_ROW["cache_utilization"]], 0.0), 1.0)
        return np.minimum(np.maximum(1.0 - pressure, 0.0), 1.0)  # clip, without its Python wrapper

    def _past_bound(self, prompt_len: int, workers: list[WorkerState]) -> bool:
        """Is the prompt longer than the requests term's bound (tokens, or a share of the smallest
        device among the candidates that report one)? Where none reports its device, a share bound
        leaves the term out: unbounded, it moves long contexts (docs/router.md, "Round 29")."""
        if prompt_len > self._max_prompt:
            return True
        if self._max_share == float("inf"):
            return False
        devices = [w.device_tokens for w in workers if w.device_tokens > 0]
        return not devices or prompt_len > self._max_share * min(devices)
