"""A whole benchmark: a concurrency sweep (or one open-loop replay), saved and plotted.

For each concurrency C (closed loop), or once (open loop):

1. scrape the server's ``/metrics`` (prompt-token counters),
2. replay the trace (``runner.replay``) with run salt = ``salt + index``, so
   every sweep point's session content is new to the server while the
   global shared prefix stays cacheable,
3. scrape ``/metrics`` again and summarize (``metrics.summarize``),
4. write ``runs/<label>/`` (requests + summary).

Then ``summary.json`` (every run, Pareto front, values at targets),
``pareto.png`` and ``latency_cdf.png``.

Example config (what ``disagg bench`` builds from its flags)::

    BenchParams(url="http://127.0.0.1:8000", trace="t.jsonl",
                concurrency=[1, 2, 4], out="results/", duration_s=300, warmup_s=30)
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from disagg.tools.bench.client import OpenAIClient, RequestResult
from disagg.tools.bench.cost import gpu_hour_price
from disagg.tools.bench.metrics import SLO, RunSummary, format_summary, summarize
from disagg.tools.bench.pareto import DEFAULT_TARGETS
from disagg.tools.bench.report import latency_lists, load_sweep, save_run, save_sweep, sweep_points
from disagg.tools.bench.runner import RunConfig, RunOutput, replay
from disagg.tools.bench.servermetrics import DEFAULT_COUNTER, cache_delta, reuse_delta
from disagg.tools.bench.tokens import TokenFactory, shared_hash_ids
from disagg.tools.bench.trace import DEFAULT_BLOCK_SIZE, TraceRecord


@dataclass(slots=True)
class BenchParams:
    """Everything one ``disagg bench`` invocation needs."""

    url: str  # server base URL
    trace: str  # trace JSONL path
    out: str = "results"  # output directory
    concurrency: list[int] = field(default_factory=lambda: [1])  # closed-loop sweep points
    mode: str = "closed"  # closed | open
    duration_s: float | None = None  # measured seconds per run
    max_requests: int | None = None  # measured requests per run
    warmup_s: float = 0.0
    warmup_requests: int = 0
    think_cap_ms: float = 30_000.0
    think_scale: float = 1.0
    speedup: float = 1.0
    sample_start_turn: bool = False
    session_end: bool = False  # each session's last turn sends session_end (runner docstring)
    delete_sessions: bool = False  # after each session's last turn, DELETE /v1/sessions/{id} (runner docstring)
    ramp_s: float = 0.0
    salt: int = 1  # run salt of the first sweep point
    seed: int = 0
    num_gpus: int = 1
    gpu_cost: str | None = None  # price spec, see cost.py
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    targets: list[float] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"
    prompt_mode: str = "tokens"
    transport: str = "auto"  # streaming client: auto | raw | aiohttp (see client.py)
    vocab_size: int = 32_000
    first_token_id: int = 100
    default_block_size: int = DEFAULT_BLOCK_SIZE
    metrics_path: str = "/metrics"
    metrics_counter: str = DEFAULT_COUNTER
    parquet: bool = False
    record_chunks: bool = False
    plots: bool = True
    progress: bool = True
    quiet: bool = False

    def run_configs(self) -> list[RunConfig]:
        common = dict(
            duration_s=self.duration_s,
            max_requests=self.max_requests,
            warmup_s=self.warmup_s,
            warmup_requests=self.warmup_requests,
            think_cap_ms=self.think_cap_ms,
            think_scale=self.think_scale,
            speedup=self.speedup,
            sample_start_turn=self.sample_start_turn,
            session_end=self.session_end,
            delete_sessions=self.delete_sessions,
            ramp_s=self.ramp_s,
            seed=self.seed,
            progress=self.progress,
        )
        if self.mode == "open":
            return [
                RunConfig(
                    mode="open",
                    run_salt=self.salt,
                    label=f"open-x{self.speedup:g}",
                    recycle=False,
                    **common,
                )
            ]
        recycle = self.duration_s is not None or self.max_requests is not None
        return [
            RunConfig(
                mode="closed",
                concurrency=c,
                run_salt=self.salt + i,
                label=f"c{c}",
                recycle=recycle,
                **common,
            )
            for i, c in enumerate(self.concurrency)
        ]


async def _scrape(client: OpenAIClient, path: str) -> str | None:
    try:
        return await client.get_text(path)
    except Exception:
        return None


async def run_bench(params: BenchParams, records: list[TraceRecord]) -> dict:
    """Run the sweep, write results under ``params.out``; returns the summary document."""
    price = gpu_hour_price(params.gpu_cost) if params.gpu_cost else None
    slo = SLO(params.slo_ttft_ms, params.slo_itl_ms)
    factory = TokenFactory(
        block_size=params.default_block_size,
        vocab_size=params.vocab_size,
        first_id=params.first_token_id,
        seed=params.seed,
        shared_ids=shared_hash_ids(records),
    )
    max_conn = max(params.concurrency) if params.mode == "closed" else 0
    runs: list[tuple[RunOutput, RunSummary]] = []
    seen: dict[int, int] = {}  # the sweep's infinite cache (runner.Replayer)
    async with OpenAIClient(
        params.url,
        model=params.model,
        api_key=params.api_key,
        endpoint=params.endpoint,
        prompt_mode=params.prompt_mode,
        max_connections=max_conn,
        transport=params.transport,
    ) as client:
        for cfg in params.run_configs():
            before = await _scrape(client, params.metrics_path)
            output = await replay(client, factory, records, cfg, seen)
            after = await _scrape(client, params.metrics_path)
            server = cache_delta(before, after, counter=params.metrics_counter)
            summary = summarize(
                output.results,
                num_gpus=params.num_gpus,
                slo=slo,
                server=server,
                theoretical_hit=output.theoretical_hit,
                reuse=reuse_table(reuse_delta(before, after), output),
                usd_per_gpu_hour=price,
            )
            save_run(
                params.out, output, summary, parquet=params.parquet, chunks=params.record_chunks
            )
            runs.append((output, summary))
            if not params.quiet:
                print(format_summary(summary, cfg.label), flush=True)
            if output.sessions_delete_failed:
                print(f"{cfg.label}: the server refused {output.sessions_delete_failed} of "
                      f"{output.sessions_deleted} session deletes", file=sys.stderr, flush=True)
            failed = [r for r in output.results if r.error]
            if failed:  # even with --quiet: the reason is otherwise only in requests.jsonl
                print(
                    f"{cfg.label}: {len(failed)} of {len(output.results)} requests failed; first: "
                    f"{describe_failure(failed[0])}",
                    file=sys.stderr,
                    flush=True,
                )
    config = asdict(params)
    config.pop("api_key", None)
    config["model"] = client.model
    config["transport"] = client.transport  # what "auto" chose
    save_sweep(params.out, config, runs, params.targets)
    doc = load_sweep(params.out)
    if params.plots:
        write_plots(doc, params.targets)
    return doc


def describe_failure(result: RequestResult) -> str:
    """``http_4xx (HTTP 400): token ids must be in [0, 512)``: the error class, the status and the
    server's message (an OpenAI error body's ``message``, else the start of the body)."""
    detail = result.error_detail.strip()
    try:
        err = json.loads(detail).get("error")
        detail = str(err.get("message", err) if isinstance(err, dict) else err or detail)
    except (ValueError, AttributeError):
        pass
    status = f" (HTTP {result.status})" if result.status is not None else ""
    return f"{result.error}{status}: {detail[:200] or 'no detail'}"


def reuse_table(delta: dict, output) -> dict:
    """The run's miss table: the server's missed tokens by reason, plus ``hash_mismatch`` (tokens the
    client counts reusable that the server never saw as such) and ``unattributed`` (what is left of
    theoretical - realized: usage and the server's counters disagreeing). Over every successful
    request of the run, warm-up included, as the counters are; empty without the counters."""
    if not delta:
        return {}
    ok = [r for r in output.results if r.ok]
    prompt = sum(r.prompt_tokens or r.input_length for r in ok)
    realized = sum(r.cached_tokens or 0 for r in ok)
    theoretical = output.theoretical_tokens_all
    rows = dict(delta["misses"])
    rows["hash_mismatch"] = theoretical - delta["bound_tokens"]
    rows["unattributed"] = (theoretical - realized) - sum(rows.values())
    return {"prompt_tokens": prompt, "theoretical_tokens": theoretical, "realized_tokens": realized,
            "server_bound_tokens": delta["bound_tokens"], "misses": rows}


def write_plots(doc: dict, targets: list[float] | None = None) -> list[Path]:
    """Pareto and latency-CDF PNGs next to a loaded sweep's summary.json."""
    from disagg.tools.bench.plots import plot_latency_cdfs, plot_pareto

    out = Path(doc["_dir"])
    tg = (
        targets
        or [t["interactivity"] for t in doc["pareto"]["at_targets"]]
        or list(DEFAULT_TARGETS)
    )
    points, labels = sweep_points(doc)
    name = Path(doc["config"].get("trace", "run")).stem
    paths = [plot_pareto([(name, points, labels)], out / "pareto.png", tg)]
    paths.append(plot_latency_cdfs(latency_lists(doc), out / "latency_cdf.png"))
    return paths


def run_bench_sync(params: BenchParams, records: list[TraceRecord]) -> dict:
    """:func:`run_bench` in a fresh event loop (uvloop when installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_bench(params, records))
    return uvloop.run(run_bench(params, records))
