"""Engine cost model: what a prefill step, a decode step and a state transfer cost in time.

    prefill step  = a + sum_j [ b * n_j + c * n_j * (ctx_j + n_j / 2) ]
                    n_j new tokens of job j in the step, ctx_j tokens before them
    decode step   = d + e * batch + f * sum(context)
                    or, with a batch curve [(B_i, g_i)], g(batch) + f * sum(context),
                    g piecewise linear through the points (extrapolated linearly past the ends)
    transfer      = bytes / bandwidth[tier] + latency[tier]
    state bytes   = tokens * bytes_per_token + checkpoint_bytes
    TTFT         += request_overhead_s          (client -> replica and back: HTTP, proxy hops)
    disaggregated: + disagg_overhead_s          (the hop to a prefill replica and its handle)

Defaults are roughly an H200 running a `small` hybrid model (a few billion
active parameters): ~25K prefill tokens/s per GPU at short context, ~12 ms
decode steps at moderate batch, 50 GB/s pinned host links.

A plain JSON cost model holds any subset of the fields, e.g.::

    {"prefill_per_token_s": 4e-5, "decode_base_s": 0.012,
     "bandwidth_gbps": {"host": 50, "disk": 5, "remote": 20}}

Measured engine profiles (points, provenance, fitted coefficients) are the
richer format of ``disagg.costs.profile``; ``cost_profile`` loads either, and
the named profiles in ``disagg/costs/profiles/``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields


def _bw() -> dict[str, float]:
    return {"host": 50.0, "disk": 5.0, "remote": 20.0}


def _lat() -> dict[str, float]:
    return {"host": 50e-6, "disk": 500e-6, "remote": 1e-3}


@dataclass(slots=True)
class CostModel:
    prefill_base_s: float = 0.004  # a: fixed cost of a step with prefill
    prefill_per_token_s: float = 4e-5  # b: linear cost per new token
    prefill_attn_s: float = 1e-10  # c: attention cost per new token per context token
    decode_base_s: float = 0.008  # d: fixed cost of a decode step
    decode_per_seq_s: float = 1e-4  # e: per sequence in the batch
    decode_per_ctx_token_s: float = 2e-9  # f: per context token in the batch
    bytes_per_token: float = 4608.0  # MLA bytes per token (all MLA layers)
    checkpoint_bytes: float = 16e6  # one KDA checkpoint
    bandwidth_gbps: dict[str, float] = field(default_factory=_bw)  # tier -> GB/s into device
    latency_s: dict[str, float] = field(default_factory=_lat)  # tier -> per transfer
    max_prefill_tokens_per_step: int = 8192  # chunked-prefill budget (decode tokens count against it)
    max_decode_batch: int = 64  # decode slots
    request_overhead_s: float = 0.0  # fixed TTFT overhead of the serving path (HTTP, proxies)
    disagg_overhead_s: float = 0.0  # extra fixed TTFT of a remote prefill (hop, handle, publish)
    decode_batch_curve: list[tuple[int, float]] | None = None  # [(batch, seconds at zero context)], sorted

    def _curve(self, batch: int) -> float:
        pts = self.decode_batch_curve
        assert pts, "no batch curve"
        if len(pts) == 1:
            return pts[0][1]
        i = 1
        while i < len(pts) - 1 and pts[i][0] < batch:
            i += 1
        (b0, g0), (b1, g1) = pts[i - 1], pts[i]
        return max(g0 + (g1 - g0) * (batch - b0) / (b1 - b0), 0.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and v < 0:
                raise ValueError(f"{f.name} must be >= 0")
        if self.max_prefill_tokens_per_step <= 0 or self.max_decode_batch <= 0:
            raise ValueError("step budgets must be positive")
        if any(bw <= 0 for bw in self.bandwidth_gbps.values()):
            raise ValueError("bandwidths must be positive")
        if self.decode_batch_curve is not None:
            pts = sorted((int(b), float(g)) for b, g in self.decode_batch_curve)
            if not pts or any(g < 0 or b < 1 for b, g in pts) or len({b for b, _ in pts}) != len(pts):
                raise ValueError("decode_batch_curve needs distinct batches >= 1 and times >= 0")
            self.decode_batch_curve = pts

    def prefill_job_time(self, new_tokens: int, context: int) -> float:
        """Cost of ``new_tokens`` after ``context`` tokens, without the step's fixed cost."""
        n = new_tokens
        return self.prefill_per_token_s * n + self.prefill_attn_s * n * (context + n / 2)

    def prefill_time(self, new_tokens: int, context: int = 0) -> float:
        """One-job prefill step."""
        return self.prefill_base_s + self.prefill_job_time(new_tokens, context)

    def decode_step_time(self, batch: int, sum_context: int) -> float:
        if batch == 0:
            return 0.0
        if self.decode_batch_curve:
            return self._curve(batch) + self.decode_per_ctx_token_s * sum_context
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * sum_context

    def transfer_time(self, nbytes: float, tier: str) -> float:
        if tier == "device" or nbytes <= 0:
            return 0.0
        return nbytes / (self.bandwidth_gbps[tier] * 1e9) + self.latency_s.get(tier, 0.0)

    def state_bytes(self, tokens: int, checkpoints: int = 1) -> float:
        return tokens * self.bytes_per_token + checkpoints * self.checkpoint_bytes

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_per_token_s if self.prefill_per_token_s else float("inf")

    @classmethod
    def from_dict(cls, cfg: dict) -> CostModel:
        unknown = set(cfg) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown cost model fields {sorted(unknown)}")
        return cls(**cfg)

    @classmethod
    def from_json(cls, path: str) -> CostModel:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, dict] = {
    "small": {},
    "large": {
        "prefill_per_token_s": 1.2e-4,
        "prefill_attn_s": 3e-10,
        "decode_base_s": 0.02,
        "bytes_per_token": 13824.0,
        "checkpoint_bytes": 140e6,
    },
}
