"""Prefix scorer: credit for the resumable prefix, tier- and transfer-aware.

For worker w with resumable length c_w read from (slowest) tier t_w:

    common     = tokens of the leading blocks most candidates hold and resume (hot prefix)
    useful_w   = max(c_w - common, 0)
    saved_s    = c_w / prefill_tokens_per_s                  compute the hit avoids
    xfer_s     = (c_w * bytes_per_token + checkpoint_bytes) / bw[t_w] + latency[t_w]
                 (0 for the device tier)
    credit_w   = tier_weight[t_w] * useful_w * max(1 - xfer_s / saved_s, 0)
    score_w    = credit_w / max(prompt_len - common, 1)        in [0, 1]

Only the part beyond the commonly held prefix earns credit, so a shared
system prompt cached everywhere (or nearly everywhere) cannot pin traffic to
the worker that happens to hold a few more of its blocks.

Config example (YAML)::

    prefix:
      tier_weights: {device: 1.0, host: 0.85, disk: 0.5, remote: 0.4}
      bandwidth_gbps: {host: 50, disk: 5, remote: 20}
      bytes_per_token: 4608
      prefill_tokens_per_s: 20000
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from disagg.router.context import RoutingContext
from disagg.router.scorers.base import ArrayScorer
from disagg.router.types import TIER_INDEX, TIERS, WorkerState


def _default_weights() -> dict[str, float]:
    return {"device": 1.0, "host": 0.85, "disk": 0.5, "remote": 0.4}


def _default_bw() -> dict[str, float]:
    return {"host": 50.0, "disk": 5.0, "remote": 20.0}


def _default_latency() -> dict[str, float]:
    return {"host": 50e-6, "disk": 500e-6, "remote": 1e-3}


@dataclass(slots=True)
class PrefixScorerConfig:
    tier_weights: dict[str, float] = field(default_factory=_default_weights)  # per tier, 0..1
    bandwidth_gbps: dict[str, float] = field(default_factory=_default_bw)  # tier -> device link
    latency_s: dict[str, float] = field(default_factory=_default_latency)  # per-transfer setup
    bytes_per_token: float = 4608.0  # MLA bytes per token (all MLA layers)
    checkpoint_bytes: float = 16e6  # one KDA checkpoint (all shards)
    prefill_tokens_per_s: float = 20000.0  # compute rate the hit saves
    discount_common: bool = True  # credit only beyond the hot shared prefix

    def __post_init__(self) -> None:
        for tier, w in self.tier_weights.items():
            if tier not in TIER_INDEX or not 0.0 <= w <= 1.0:
                raise ValueError(f"bad tier weight {tier!r}: {w}")
        for tier, bw in self.bandwidth_gbps.items():
            if bw <= 0:
                raise ValueError(f"bandwidth for {tier!r} must be positive")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")


class PrefixScorer(ArrayScorer):
    """Scores the fraction of the (non-common) prompt a worker can skip."""

    name = "prefix"

    def __init__(self, config: PrefixScorerConfig | None = None, **params: object):
        self.config = cfg = config or PrefixScorerConfig(**params)  # type: ignore[arg-type]
        # per tier index (row 4 = "no resume", what tier -1 selects); device reads cost nothing
        moved = [t != "device" and t in cfg.bandwidth_gbps for t in TIERS]
        self._tier_params = np.array([  # rows: weight, 1 / bandwidth (B/s), latency; column per tier
            [cfg.tier_weights.get(t, 0.0) for t in TIERS] + [0.0],
            [1.0 / (cfg.bandwidth_gbps[t] * 1e9) if m else 0.0 for t, m in zip(TIERS, moved, strict=True)] + [0.0],
            [cfg.latency_s.get(t, 0.0) if m else 0.0 for t, m in zip(TIERS, moved, strict=True)] + [0.0],
        ])
        self._tier_rows = [tuple(col) for col in self._tier_params.T.tolist()]  # tier index -> (weight, 1/bw, lat)

    def tier_factor(self, tier: str | None, cached_tokens: int) -> float:
        """tier_weight * max(1 - transfer_time / saved_compute_time, 0)."""
        if tier is None or cached_tokens <= 0:
            return 0.0
        cfg = self.config
        weight = cfg.tier_weights.get(tier, 0.0)
        if tier == "device":
            return weight
        bw = cfg.bandwidth_gbps.get(tier)
        if bw is None:
            return weight
        xfer = (cached_tokens * cfg.bytes_per_token + cfg.checkpoint_bytes) / (bw * 1e9)
        xfer += cfg.latency_s.get(tier, 0.0)
        saved = cached_tokens / cfg.prefill_tokens_per_s
        return weight * max(1.0 - xfer / saved, 0.0)

    def credit(self, ctx: RoutingContext, worker_id: str) -> float:
        """Tokens of credit (before normalization)."""
        m = ctx.prefix(worker_id)
        common = ctx.common_tokens() if self.config.discount_common else 0
        useful = max(m.resumable_tokens - common, 0)
        return useful * self.tier_factor(m.tier, m.resumable_tokens)

    def score_array(self, ctx: RoutingContext, workers: list[WorkerState]) -> np.ndarray:
        cfg = self.config
        common = ctx.common_tokens() if cfg.discount_common else 0
        denom = max(ctx.request.prompt_len - common, 1)
        v = ctx.view(workers)
        out = np.zeros(len(v.resumable))
        earn = (v.resumable > common).nonzero()[0]  # usually a few workers: compute only theirs
        if not earn.size:
            return out
        if earn.size <= 4:  # the same formula in Python floats (the same IEEE operations, in order)
            rows, bpt, ckpt, rate = self._tier_rows, cfg.bytes_per_token, cfg.checkpoint_bytes, cfg.prefill_tokens_per_s
            for i, c, t in zip(earn.tolist(), v.resumable[earn].tolist(), v.tier[earn].tolist(), strict=True):
                weight, inv_bw, lat = rows[t]
                xfer = (c * bpt + ckpt) * inv_bw + lat
                factor = weight * max(1.0 - xfer / (max(c, 1.0) / rate), 0.0)
                out[i] = min((c - common) * factor / denom, 1.0)
            return out
        c = v.resumable[earn]
        weight, inv_bw, lat = self._tier_params[:, v.tier[earn]]
        xfer = (c * cfg.bytes_per_token + cfg.checkpoint_bytes) * inv_bw + lat
        saved = np.maximum(c, 1.0) / cfg.prefill_tokens_per_s
        factor = weight * np.maximum(1.0 - xfer / saved, 0.0)
        out[earn] = np.minimum((c - common) * factor / denom, 1.0)
        return out
