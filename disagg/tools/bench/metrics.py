"""Run metrics: latency distributions, throughput per GPU, cache hit, goodput, cost.

Definitions (``ok`` = successful requests outside warm-up):

- TTFT = first token chunk - send; E2E = last token chunk - send;
  ITL (per request) = (E2E - TTFT) / (output tokens - 1), requests with at
  least 2 output tokens. Percentiles use linear interpolation between order
  statistics (numpy's default): P90 of 10, 20, ..., 100 is 91.
- P90 interactivity = 1000 / P90 ITL (ms) tokens/s/user (TTFT excluded).
- Window = first measured send -> last measured end. Throughputs are tokens
  of ``ok`` requests / window / ``num_gpus``: total (input + output), output,
  input, uncached input (input - cached; cached from usage, else from the
  server counters).
- Cache hit three ways: ``usage`` = sum cached / sum prompt tokens;
  ``server`` = counter deltas (see ``servermetrics``); ``theoretical`` =
  infinite-cache hit rate of the replayed prompts (salts applied), over the
  measured requests that succeeded (the ones ``usage`` covers).
- Goodput = ``ok`` requests meeting every given SLO (TTFT <= slo_ttft_ms and
  ITL <= slo_itl_ms) / window.
- A run is invalid when more than 10% of its measured requests fail.
- Cost: tokens/s/GPU x 3600 / ($ per GPU-hour) tokens per dollar.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from disagg.tools.bench.client import RequestResult
from disagg.tools.bench.cost import tokens_per_dollar, usd_per_million_tokens
from disagg.tools.bench.servermetrics import ServerCacheStats
from disagg.tools.bench.stats import Dist

MAX_FAILURE_RATE = 0.10


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy default); NaN for no values."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(slots=True)
class SLO:
    """Service-level objectives for goodput (None: not constrained)."""

    ttft_ms: float | None = None  # time to first token limit
    itl_ms: float | None = None  # per-request inter-token latency limit

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_ms is None or r.ttft_ms > self.ttft_ms):
            return False
        itl = r.itl_ms
        return self.itl_ms is None or itl is None or itl <= self.itl_ms


@dataclass(slots=True)
class RunSummary:
    """Metrics of one run (one concurrency or one open-loop replay)."""

    num_requests: int  # measured (non-warm-up) requests
    num_ok: int
    num_failed: int
    num_warmup: int
    errors: dict[str, int]  # error class -> count
    failure_rate: float
    valid: bool  # failure_rate <= 10%
    duration_s: float  # measurement window
    num_gpus: int
    ttft_ms: Dist
    itl_ms: Dist  # per-request ITL
    e2e_ms: Dist
    chunk_gap_ms: Dist  # gaps between consecutive token chunks (all requests)
    p90_interactivity: float  # tokens/s/user = 1000 / P90 ITL
    input_tokens: int
    output_tokens: int
    cached_tokens: int | None  # from usage
    request_rate: float  # ok requests/s
    total_tps_per_gpu: float
    output_tps_per_gpu: float
    input_tps_per_gpu: float
    uncached_input_tps_per_gpu: float | None
    cache_hit_usage: float | None
    cache_hit_server: float | None
    cache_hit_theoretical: float | None
    server_cache: dict = field(default_factory=dict)
    reuse: dict = field(default_factory=dict)  # miss table (``sweep.reuse_table``); empty without server counters
    slo: dict = field(default_factory=dict)
    goodput_rps: float | None = None
    goodput_fraction: float | None = None
    usd_per_gpu_hour: float | None = None
    tokens_per_dollar: float | None = None
    usd_per_million_tokens: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(
    results: Sequence[RequestResult],
    *,
    num_gpus: int = 1,
    slo: SLO | None = None,
    server: ServerCacheStats | None = None,
    theoretical_hit: float | None = None,
    reuse: dict | None = None,
    usd_per_gpu_hour: float | None = None,
) -> RunSummary:
    """Summarize one run's results (warm-up requests are counted, then excluded)."""
    if num_gpus < 1:
        raise ValueError("num_gpus must be >= 1")
    measured = [r for r in results if not r.warmup]
    ok = [r for r in measured if r.ok]
    failed = len(measured) - len(ok)
    errors = dict(Counter(r.error for r in measured if r.error))
    failure_rate = failed / len(measured) if measured else 1.0
    if measured:
        start = min(r.send_ns for r in measured)
        end = max(r.end_ns or r.send_ns for r in measured)
        duration = max((end - start) / 1e9, 1e-9)
    else:
        duration = float("nan")
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    itl = [v for r in ok if (v := r.itl_ms) is not None]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    gaps = (
        np.concatenate(
            [np.diff(np.asarray(r.chunk_ns, dtype=np.int64)) for r in ok if len(r.chunk_ns) > 1]
            or [np.zeros(0)]
        )
        / 1e6
    )
    input_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else r.input_length for r in ok
    )
    output_tokens = sum(r.output_tokens for r in ok)
    with_usage = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens or 0 for r in with_usage) if with_usage else None
    hit_usage = (cached / sum(r.prompt_tokens or 0 for r in with_usage)) if with_usage else None
    server_hit = server.hit_rate if server is not None and server.available else None
    uncached: float | None = None
    if cached is not None and len(with_usage) == len(ok):
        uncached = input_tokens - cached
    elif server_hit is not None:
        uncached = input_tokens * (1.0 - server_hit)
    per_gpu = 1.0 / (duration * num_gpus)
    p90_itl = percentile(itl, 90)
    total_tps = (input_tokens + output_tokens) * per_gpu if measured else 0.0
    summary = RunSummary(
        num_requests=len(measured),
        num_ok=len(ok),
        num_failed=failed,
        num_warmup=len(results) - len(measured),
        errors=errors,
        failure_rate=failure_rate,
        valid=bool(measured) and failure_rate <= MAX_FAILURE_RATE,
        duration_s=duration,
        num_gpus=num_gpus,
        ttft_ms=Dist.of(ttft),
        itl_ms=Dist.of(itl),
        e2e_ms=Dist.of(e2e),
        chunk_gap_ms=Dist.of(gaps),
        p90_interactivity=1000.0 / p90_itl if p90_itl > 0 else float("nan"),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_tokens=cached,
        request_rate=len(ok) / duration if measured else 0.0,
        total_tps_per_gpu=total_tps,
        output_tps_per_gpu=output_tokens * per_gpu if measured else 0.0,
        input_tps_per_gpu=input_tokens * per_gpu if measured else 0.0,
        uncached_input_tps_per_gpu=uncached * per_gpu
        if uncached is not None and measured
        else None,
        cache_hit_usage=hit_usage,
        cache_hit_server=server_hit,
        cache_hit_theoretical=theoretical_hit,
        server_cache=server.to_dict() if server is not None else {},
        reuse=reuse or {},
    )
    if slo is not None and (slo.ttft_ms is not None or slo.itl_ms is not None):
        good = sum(1 for r in ok if slo.met(r))
        summary.slo = {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms}
        summary.goodput_rps = good / duration if measured else 0.0
        summary.goodput_fraction = good / len(measured) if measured else None
    if usd_per_gpu_hour is not None:
        summary.usd_per_gpu_hour = usd_per_gpu_hour
        summary.tokens_per_dollar = tokens_per_dollar(total_tps, usd_per_gpu_hour)
        summary.usd_per_million_tokens = usd_per_million_tokens(total_tps, usd_per_gpu_hour)
    return summary


def format_reuse(reuse: dict) -> list[str]:
    """The miss-reason table: tokens and share of the run's prompt tokens per reason."""
    prompt = max(reuse["prompt_tokens"], 1)
    theo, real = reuse["theoretical_tokens"], reuse["realized_tokens"]
    lines = [f"reuse  realized / theoretical {real / theo:.3f}" if theo else "reuse  theoretical 0",
             f"  {'reason':<16}{'tokens':>12}{'% of prompt':>13}"]
    for reason, n in sorted(reuse["misses"].items(), key=lambda kv: -abs(kv[1])):
        lines.append(f"  {reason:<16}{n:>12,.0f}{100 * n / prompt:>12.2f}%")
    lines.append(f"  {'theor. - real.':<16}{theo - real:>12,.0f}{100 * (theo - real) / prompt:>12.2f}%")
    return lines


def format_summary(s: RunSummary, label: str = "") -> str:
    """A compact human-readable block for one run."""

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1%}"

    lines = [
        f"== {label}" if label else "== run",
        f"requests {s.num_requests} ok {s.num_ok} failed {s.num_failed} (warm-up {s.num_warmup})"
        f"{'' if s.valid else '  INVALID: >10% failed'}  errors {s.errors or '-'}",
        f"window {s.duration_s:.1f} s  GPUs {s.num_gpus}  requests/s {s.request_rate:.2f}",
        f"TTFT ms   mean {s.ttft_ms.mean:9.1f}  p50 {s.ttft_ms.p50:9.1f}  p90 {s.ttft_ms.p90:9.1f}"
        f"  p99 {s.ttft_ms.p99:9.1f}",
        f"ITL ms    mean {s.itl_ms.mean:9.2f}  p50 {s.itl_ms.p50:9.2f}  p90 {s.itl_ms.p90:9.2f}"
        f"  p99 {s.itl_ms.p99:9.2f}",
        f"E2E ms    mean {s.e2e_ms.mean:9.1f}  p50 {s.e2e_ms.p50:9.1f}  p90 {s.e2e_ms.p90:9.1f}"
        f"  p99 {s.e2e_ms.p99:9.1f}",
        f"P90 interactivity {s.p90_interactivity:.1f} tok/s/user",
        f"tok/s/GPU total {s.total_tps_per_gpu:,.1f}  output {s.output_tps_per_gpu:,.1f}  "
        f"input {s.input_tps_per_gpu:,.1f}  uncached input "
        f"{'n/a' if s.uncached_input_tps_per_gpu is None else f'{s.uncached_input_tps_per_gpu:,.1f}'}",
        f"cache hit  usage {pct(s.cache_hit_usage)}  server {pct(s.cache_hit_server)}  "
        f"theoretical {pct(s.cache_hit_theoretical)}",
    ]
    if s.reuse:
        lines.extend(format_reuse(s.reuse))
    if s.goodput_rps is not None:
        lines.append(
            f"goodput {s.goodput_rps:.2f} req/s ({pct(s.goodput_fraction)} of requests) "
            f"at SLO {s.slo}"
        )
    if s.tokens_per_dollar is not None:
        lines.append(
            f"cost  {s.tokens_per_dollar / 1e6:,.2f}M tokens/$  "
            f"${s.usd_per_million_tokens:.4f} per M tokens at ${s.usd_per_gpu_hour}/GPU-h"
        )
    return "\n".join(lines)
