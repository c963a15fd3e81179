"""The agentic benchmark end to end: a small closed-loop sweep against the real Serve stacks.

One local Ray cluster serves the embedded default disaggregated (prefill +
decode replicas sharing the node's host tier) at ``/`` and the same config
aggregated at ``/agg``; the ``disagg.tools.bench`` harness replays a CPU-sized
synthetic agentic trace against both (concurrency 1 and 2, a few requests
each), then draws the Pareto, latency-CDF and A/B figures.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from disagg.config import load_config
from tests.helpers import free_port

pytestmark = pytest.mark.ray
CONFIG = Path(__file__).parents[2] / "deployments" / "configs" / "local-cpu.yaml"
CONCURRENCY = [1, 2]
REQUESTS, WARMUP = 6, 1  # measured / warm-up requests per sweep point
TARGETS = [20.0, 40.0]
PNG = b"\x89PNG\r\n\x1a\n"


def _trace():
    """Prompts ~400-1000 tokens (64-token blocks, 384-token shared prefix), outputs 8-24."""
    from disagg.tools.bench.synth import SynthConfig, synthesize

    records = synthesize(
        6,
        0,
        block_size=64,
        scale=0.025,
        turn_scale=0.25,
        max_input=1000,
        subagents=False,
        config=SynthConfig(output_median=560.0, output_p90=880.0),
    )
    return [dataclasses.replace(r, output_length=min(24, max(8, r.output_length))) for r in records]



@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    from ray import serve

    from deployments.app import build_app
    from disagg.launch.local import local_app, wait_healthy
    from disagg.tools.bench.plots import plot_compare
    from disagg.tools.bench.report import sweep_points
    from disagg.tools.bench.sweep import BenchParams, run_bench_sync
    from disagg.tools.bench.trace import save_trace

    out = tmp_path_factory.mktemp("bench-e2e")
    records = _trace()
    trace = out / "trace.jsonl"
    save_trace(records, trace)
    cfg = load_config(CONFIG)
    cfg.http.port = free_port()
    agg = cfg.model_copy(deep=True)
    agg.deployment.mode = "aggregated"
    docs = {}
    with local_app(cfg) as url:
        serve.run(build_app(agg), name="agg", route_prefix="/agg", blocking=False)
        urls = {"disagg": url, "agg": url + "/agg"}
        for name, base in urls.items():
            wait_healthy(base)
            params = BenchParams(
                url=base,
                trace=str(trace),
                out=str(out / name),
                concurrency=CONCURRENCY,
                max_requests=REQUESTS,
                warmup_requests=WARMUP,
                think_cap_ms=1000,
                think_scale=0.02,
                salt=1 if name == "disagg" else 101,
                num_gpus=2 if name == "disagg" else 1,
                targets=TARGETS,
                vocab_size=259,
                first_token_id=3,
                default_block_size=64,
                progress=False,
                quiet=True,
            )
            docs[name] = run_bench_sync(params, records)
    compare, rows = plot_compare(
        ("aggregated", *sweep_points(docs["agg"])),
        ("disaggregated", *sweep_points(docs["disagg"])),
        out / "compare.png",
        TARGETS,
    )
    return {"out": out, "docs": docs, "records": records, "compare": compare, "rows": rows}


def _runs(doc: dict) -> dict[str, dict]:
    return {e["label"]: e["summary"] for e in doc["runs"]}


@pytest.mark.parametrize("stack,gpus", [("disagg", 2), ("agg", 1)])
def test_sweep_summary_is_sane(sweeps, stack, gpus):
    out = sweeps["out"] / stack
    doc = json.loads((out / "summary.json").read_text())
    runs = _runs(doc)
    assert sorted(runs) == [f"c{c}" for c in CONCURRENCY]
    for label, s in runs.items():
        assert s["valid"] and s["num_failed"] == 0, (label, s["errors"])
        assert s["num_requests"] == REQUESTS and s["num_warmup"] >= WARMUP, label
        assert s["num_gpus"] == gpus
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] < 60_000, label
        assert 0 < s["itl_ms"]["p50"] <= s["itl_ms"]["p90"] < 10_000, label
        assert s["p90_interactivity"] == pytest.approx(1000 / s["itl_ms"]["p90"])
        assert s["total_tps_per_gpu"] > s["output_tps_per_gpu"] > 0
        assert s["cache_hit_theoretical"] > 0.5, "later turns repeat earlier blocks"
        assert s["cache_hit_server"] is not None, "the /metrics prompt-token counters were read"
        assert 0 <= s["cache_hit_usage"] <= 1
    # what the server says it got is what the trace asked for
    lengths = {(r.session_id, r.turn): (r.input_length, r.output_length) for r in sweeps["records"]}
    for label in runs:
        rows = [json.loads(line) for line in (out / "runs" / label / "requests.jsonl").open()]
        assert len(rows) >= REQUESTS + WARMUP
        for r in rows:
            assert r["error"] is None, r
            assert (r["prompt_tokens"], r["output_tokens"]) == lengths[
                (r["session_id"], r["turn"])
            ], r
            assert 0 <= r["cached_tokens"] < r["prompt_tokens"]


def test_disaggregated_run_reuses_state(sweeps):
    runs = _runs(sweeps["docs"]["disagg"])
    assert max(s["cache_hit_usage"] for s in runs.values()) > 0, "no turn resumed a stored state"
    assert max(s["cache_hit_server"] for s in runs.values()) > 0, "server counters show no reuse"
    host = [s["server_cache"]["tokens_by_source"].get("host", 0) for s in runs.values()]
    assert max(host) > 0, "reuse came from the host tier"


def test_figures_written(sweeps):
    out = sweeps["out"]
    pngs = [out / s / f for s in ("disagg", "agg") for f in ("pareto.png", "latency_cdf.png")]
    pngs.append(sweeps["compare"])
    for p in pngs:
        data = Path(p).read_bytes()
        assert data[:8] == PNG and len(data) > 5_000, p
    assert [r["target"] for r in sweeps["rows"]] == TARGETS
    doc = sweeps["docs"]["disagg"]
    assert doc["pareto"]["front"], "a front needs at least one valid run"
    assert set(doc["pareto"]["front"]) <= {f"c{c}" for c in CONCURRENCY}
