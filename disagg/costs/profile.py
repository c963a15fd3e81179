"""Engine cost profiles: measured points -> the simulator's cost model.

A profile is a JSON file (``format: disagg-sim-profile/1``) of what was
measured, where, and how; the cost model's coefficients are fitted from the
points when the profile is loaded::

    {
      "format": "disagg-sim-profile/1",
      "name": "cpu-tiny",
      "source": {"kind": "measured", "command": "disagg sim calibrate --engine tiny ...",
                 "date": "2026-11-29", "machine": "2-core CPU", "notes": ["..."]},
      "model": "tiny", "hardware": "cpu", "gpus_per_worker": 1, "block_size": 64,
      "prefill": [{"new_tokens": 1024, "context": 0, "seconds": 0.94}, ...],
      "decode":  [{"batch": 16, "context": 512, "seconds": 0.086}, ...],
      "transfer": {"host": {"gbps": 5.0, "latency_s": 1e-4}, "remote": {"gbps": 0.3, "latency_s": 2e-3}},
      "state": {"bytes_per_token": 320, "checkpoint_bytes": 1.2e6},
      "limits": {"max_prefill_tokens_per_step": 1024, "max_decode_batch": 16},
      "overheads": {"request_s": 0.12, "disagg_s": 0.03},
      "coefficients": {}
    }

``source.kind`` is one of ``measured`` (timed here), ``bench-fit`` (fitted
from a benchmark run's requests), ``published`` (vendor or paper figures),
``roofline`` (derived from a model and hardware by ``disagg plan``),
``cost-model`` (a plain ``CostModel`` JSON: coefficients only).

Fit (non-negative least squares on relative error, every point weighted
1 / seconds, so a 10 ms point counts as much as a 10 s one)::

    prefill point: seconds = a * steps + b * n + c * n * (ctx + n / 2)
                   steps = chunks of at most max_prefill_tokens_per_step (block-aligned)
    decode point:  seconds = d + e * batch + f * batch * context          (fewer than 3 batch sizes)
                   seconds = g(batch) + f * batch * context              (a batch curve: one g per
                                                                           measured batch, interpolated)

A prefill point is one request alone: a prefill of n new tokens after ctx
resumed tokens, chunked as the engine chunks it (``steps`` may be given).
``coefficients`` (any ``CostModel`` field) override the fit.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from disagg.costs.model import PROFILES, CostModel

FORMAT = "disagg-sim-profile/1"
PROFILE_DIR = Path(__file__).parent / "profiles"
SOURCE_KINDS = ("measured", "bench-fit", "published", "roofline", "cost-model")
TIERS = ("host", "disk", "remote")


@dataclass(slots=True)
class PrefillPoint:
    new_tokens: int  # tokens computed
    context: int  # tokens resumed before them
    seconds: float  # time of the whole prefill (all its chunks)
    steps: int | None = None  # engine steps it took (None: from the chunk budget)


@dataclass(slots=True)
class DecodePoint:
    batch: int  # sequences in the step
    context: int  # tokens per sequence
    seconds: float  # one decode step


@dataclass(slots=True)
class FitReport:
    """How well the fitted cost model reproduces the profile's points."""

    prefill_max_rel_err: float  # max |model - measured| / measured over prefill points
    decode_max_rel_err: float  # same over decode points
    prefill_rows: list[tuple[int, int, float, float]]  # (n, ctx, measured s, model s)
    decode_rows: list[tuple[int, int, float, float]]  # (batch, ctx, measured s, model s)

    def format(self) -> str:
        lines = ["prefill: new tokens, context, measured s, model s, error"]
        for n, c, m, p in self.prefill_rows:
            lines.append(f"  {n:>7} {c:>7} {m:>10.4f} {p:>10.4f} {100 * (p - m) / m:+6.1f}%")
        lines.append("decode step: batch, context, measured s, model s, error")
        for b, c, m, p in self.decode_rows:
            lines.append(f"  {b:>7} {c:>7} {m:>10.4f} {p:>10.4f} {100 * (p - m) / m:+6.1f}%")
        lines.append(f"max error: prefill {100 * self.prefill_max_rel_err:.1f}%  "
                     f"decode {100 * self.decode_max_rel_err:.1f}%")
        return "\n".join(lines)


def nnls_relative(features: np.ndarray, target: np.ndarray, relative: bool = True) -> np.ndarray:
    """Non-negative least squares of ``features @ x ~ target``, in relative error (or absolute).

    Exact by enumeration of the active sets (a handful of columns): the best
    residual among the unconstrained solutions of every column subset that
    come out non-negative.
    """
    if np.any(target <= 0):
        raise ValueError("measured times must be positive")
    if relative:
        a = features / target[:, None]
        y = np.ones_like(target)
    else:
        a, y = features.astype(np.float64), target.astype(np.float64)
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((a[:, cols] @ sol - y) ** 2))
            if res < best_res - 1e-15:
                best_res = res
                best = np.zeros(n)
                best[list(cols)] = sol
    return best


def _nnls_curve(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Relative-error NNLS for a batch curve: intercepts are free of each other, the slope shared.

    Solved as two candidates: the unconstrained fit (when non-negative), or the slope at 0.
    """
    a = features / target[:, None]
    y = np.ones_like(target)
    sol, *_ = np.linalg.lstsq(a, y, rcond=None)
    if np.all(sol >= 0):
        return sol
    flat = np.zeros_like(sol)
    flat[:-1], *_ = np.linalg.lstsq(a[:, :-1], y, rcond=None)
    return np.maximum(flat, 0.0)


def chunk_steps(new_tokens: int, context: int, budget: int, block_size: int) -> int:
    """Engine steps a lone prefill takes: chunks of at most ``budget``, partial ones block-aligned."""
    steps, done, end = 0, context, context + new_tokens
    while done < end:
        n = min(end - done, budget)
        if done + n < end:
            n = (done + n) // block_size * block_size - done
            if n <= 0:  # budget below one block: the engine takes a whole block
                n = block_size - done % block_size
        done += n
        steps += 1
    return steps


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {msg}")


@dataclass(slots=True)
class EngineProfile:
    """A measured (or published) engine profile; see the module docstring for the file format."""

    name: str  # profile name
    source: dict[str, Any] = field(default_factory=dict)  # kind, command, date, machine, notes
    model: str = ""  # model the points were measured with
    hardware: str = ""  # device / machine
    gpus_per_worker: int = 1  # GPUs of one engine replica (TP x DCP)
    block_size: int = 256  # tokens per KV block of the engine
    prefill: list[PrefillPoint] = field(default_factory=list)
    decode: list[DecodePoint] = field(default_factory=list)
    transfer: dict[str, dict[str, float]] = field(default_factory=dict)  # tier -> {gbps, latency_s}
    state: dict[str, float] = field(default_factory=dict)  # bytes_per_token, checkpoint_bytes
    limits: dict[str, float] = field(default_factory=dict)  # max_prefill_tokens_per_step, max_decode_batch,
    # node_compute_slots (engines a node runs at full speed at once: a cluster setting, see ClusterConfig)
    overheads: dict[str, float] = field(default_factory=dict)  # request_s, disagg_s
    memory: dict[str, float] = field(default_factory=dict)  # device_bytes, host_bytes (per node), ...
    coefficients: dict[str, Any] = field(default_factory=dict)  # CostModel fields overriding the fit
    description: str = ""

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}"
        kind = self.source.get("kind")
        _check(kind in SOURCE_KINDS, where, f"source.kind must be one of {SOURCE_KINDS}, got {kind!r}")
        _check(self.gpus_per_worker >= 1 and self.block_size >= 1, where, "gpus_per_worker and block_size >= 1")
        for i, p in enumerate(self.prefill):
            _check(p.new_tokens > 0 and p.context >= 0 and p.seconds > 0, f"{where}, prefill[{i}]",
                   "needs new_tokens > 0, context >= 0, seconds > 0")
        for i, d in enumerate(self.decode):
            _check(d.batch > 0 and d.context >= 0 and d.seconds > 0, f"{where}, decode[{i}]",
                   "needs batch > 0, context >= 0, seconds > 0")
        for tier, t in self.transfer.items():
            _check(tier in TIERS, f"{where}, transfer", f"unknown tier {tier!r}; known: {TIERS}")
            _check(t.get("gbps", 0) > 0, f"{where}, transfer.{tier}", "gbps must be > 0")
        unknown = set(self.coefficients) - set(CostModel.__dataclass_fields__)
        _check(not unknown, f"{where}, coefficients", f"unknown cost model fields {sorted(unknown)}")
        if kind in ("measured", "bench-fit"):
            _check(bool(self.prefill) or "prefill_per_token_s" in self.coefficients, where,
                   "no prefill points (and no prefill coefficients)")
            _check(bool(self.decode) or "decode_base_s" in self.coefficients, where,
                   "no decode points (and no decode coefficients)")

    # ---- fit ----------------------------------------------------------------------
    @property
    def prefill_budget(self) -> int:
        return int(self.limits.get("max_prefill_tokens_per_step", CostModel.max_prefill_tokens_per_step))

    def _prefill_features(self) -> np.ndarray:
        rows = []
        for p in self.prefill:
            steps = p.steps if p.steps is not None else chunk_steps(p.new_tokens, p.context, self.prefill_budget,
                                                                     self.block_size)
            n = p.new_tokens
            rows.append([steps, n, n * (p.context + n / 2)])
        return np.asarray(rows, np.float64)

    def _decode_features(self) -> np.ndarray:
        return np.asarray([[1.0, d.batch, d.batch * d.context] for d in self.decode], np.float64)

    def fitted(self) -> dict[str, float]:
        """Cost model coefficients fitted from the points."""
        out: dict[str, float] = {}
        if self.prefill:
            a, b, c = nnls_relative(self._prefill_features(), np.array([p.seconds for p in self.prefill]))
            out.update(prefill_base_s=float(a), prefill_per_token_s=float(b), prefill_attn_s=float(c))
        if self.decode:
            secs = np.array([p.seconds for p in self.decode])
            batches = sorted({p.batch for p in self.decode})
            if len(batches) >= 3:  # a batch curve: one intercept per batch, a shared context slope
                col = {b: i for i, b in enumerate(batches)}
                feats = np.zeros((len(self.decode), len(batches) + 1))
                for r, p in enumerate(self.decode):
                    feats[r, col[p.batch]] = 1.0
                    feats[r, -1] = p.batch * p.context
                sol = _nnls_curve(feats, secs)
                out.update(decode_batch_curve=[(b, float(sol[i])) for i, b in enumerate(batches)],
                           decode_per_ctx_token_s=float(sol[-1]), decode_base_s=float(sol[0]), decode_per_seq_s=0.0)
            else:
                d, e, f = nnls_relative(self._decode_features(), secs)
                out.update(decode_base_s=float(d), decode_per_seq_s=float(e), decode_per_ctx_token_s=float(f))
        return out

    def cost_model(self) -> CostModel:
        cfg: dict[str, Any] = self.fitted()
        if self.transfer:
            base = CostModel()
            bw, lat = dict(base.bandwidth_gbps), dict(base.latency_s)
            for tier, t in self.transfer.items():
                bw[tier] = float(t["gbps"])
                lat[tier] = float(t.get("latency_s", lat.get(tier, 0.0)))
            cfg.update(bandwidth_gbps=bw, latency_s=lat)
        for key in ("bytes_per_token", "checkpoint_bytes"):
            if key in self.state:
                cfg[key] = float(self.state[key])
        for key in ("max_prefill_tokens_per_step", "max_decode_batch"):  # node_compute_slots: not a cost
            if key in self.limits:
                cfg[key] = int(self.limits[key])
        if "request_s" in self.overheads:
            cfg["request_overhead_s"] = float(self.overheads["request_s"])
        if "disagg_s" in self.overheads:
            cfg["disagg_overhead_s"] = float(self.overheads["disagg_s"])
        cfg.update(self.coefficients)
        return CostModel.from_dict(cfg)

    def fit_report(self) -> FitReport:
        cm = self.cost_model()
        pre = []
        feats = self._prefill_features() if self.prefill else np.zeros((0, 3))
        for p, (steps, _, _) in zip(self.prefill, feats, strict=True):
            model = cm.prefill_base_s * steps + cm.prefill_job_time(p.new_tokens, p.context)
            pre.append((p.new_tokens, p.context, p.seconds, model))
        dec = [(d.batch, d.context, d.seconds, cm.decode_step_time(d.batch, d.batch * d.context))
               for d in self.decode]

        def worst(rows: list) -> float:
            return max((abs(m - s) / s for *_, s, m in rows), default=0.0)

        return FitReport(worst(pre), worst(dec), pre, dec)

    # ---- files ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for p in d["prefill"]:
            if p.get("steps") is None:
                p.pop("steps", None)
        return {"format": FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "profile") -> EngineProfile:
        if d.get("format") != FORMAT:
            raise ValueError(f"{where}: format must be {FORMAT!r}, got {d.get('format')!r}")
        body = {k: v for k, v in d.items() if k != "format"}
        unknown = set(body) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        if "name" not in body:
            raise ValueError(f"{where}: missing field 'name'")
        try:
            body["prefill"] = [PrefillPoint(**p) for p in body.get("prefill", [])]
            body["decode"] = [DecodePoint(**p) for p in body.get("decode", [])]
        except TypeError as exc:
            raise ValueError(f"{where}: bad point ({exc})") from None
        return cls(**body)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def profile_names() -> list[str]:
    """Named profiles shipped with the simulator."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """A named profile (``profile_names()``) or a JSON file: an engine profile or a plain cost model."""
    path = Path(name_or_path)
    named = PROFILE_DIR / f"{name_or_path}.json"
    if named.is_file() and not path.is_file():
        path = named
    if not path.is_file():
        raise ValueError(f"no profile {str(name_or_path)!r}: not a file, and not one of "
                         f"{', '.join(profile_names())} (or the cost models small, large)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile is a JSON object")
    if "format" not in data:  # a plain cost model: every field a CostModel field
        CostModel.from_dict(data)
        return EngineProfile(path.stem, {"kind": "cost-model"}, coefficients=data)
    return EngineProfile.from_dict(data, str(path))


def relative_error(model: float, measured: float) -> float:
    return (model - measured) / measured if measured else math.inf


def cost_profile(name_or_path: str) -> CostModel:
    """A named cost model ("small", "large"), a named engine profile (``disagg/costs/profiles``),
    or a JSON file: an engine profile or a plain cost model."""
    if name_or_path in PROFILES:
        return CostModel.from_dict(PROFILES[name_or_path])
    return load_profile(name_or_path).cost_model()
