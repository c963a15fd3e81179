"""Calibration sources: saved engine figures, benchmark requests, timing the reference engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from disagg.costs.model import CostModel
from disagg.costs.profile import DecodePoint, EngineProfile, PrefillPoint
from disagg.tools.sim.calibrate import from_bench_runs, from_engine_bench, time_engine

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "docs" / "perf" / "h200-2026-11-29"


def test_h200_figures_become_points():
    prof = from_engine_bench(H200 / "engine_fla.json", H200 / "transfer.json", chunk=8192)
    figs = json.loads((H200 / "engine_fla.json").read_text())
    pre = {(p.new_tokens, p.context): p.seconds for p in prof.prefill}
    assert pre[(8192, 0)] == pytest.approx(8192 / figs["prefill_tok_s_8192"])
    assert pre[(256, 32768)] == pytest.approx(figs["resume_32768"]["ttft_resume_memory_ms"] / 1000)
    dec = {(d.batch, d.context): d.seconds for d in prof.decode}
    assert dec[(64, 2048)] == pytest.approx(figs["decode_step_ms_b64"] / 1000)
    assert prof.transfer["host"]["gbps"] == pytest.approx(50.71308647995782)  # the slower scatter
    assert prof.cost_model().decode_step_time(16, 16 * 2048) == pytest.approx(figs["decode_step_ms_b16"] / 1000)


def _write_run(path: Path, rows: list[dict]) -> Path:
    run = path / "runs" / "c1"
    run.mkdir(parents=True)
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BASE_CM = CostModel(prefill_base_s=0.01, prefill_per_token_s=1e-3, prefill_attn_s=0.0, decode_base_s=0.02,
                    decode_per_seq_s=0.0, decode_per_ctx_token_s=1e-5, max_prefill_tokens_per_step=4096)


def base_profile() -> EngineProfile:
    pre = [PrefillPoint(n, c, BASE_CM.prefill_time(n, c)) for n, c in ((100, 0), (400, 0), (900, 0), (300, 600))]
    dec = [DecodePoint(1, c, BASE_CM.decode_step_time(1, c)) for c in (100, 1000, 3000)]
    return EngineProfile("base", {"kind": "measured"}, block_size=64, prefill=pre, decode=dec,
                         limits={"max_prefill_tokens_per_step": 4096})


def test_bench_fit_recovers_overheads_and_slowdown(tmp_path):
    """Requests generated from a known serving model: overhead 120 ms, remote +40 ms, 1.5x slower prefill,
    1.25x slower decode; one request at a time (think time between), as a concurrency-1 run records."""
    rng = np.random.default_rng(0)
    rows, t = [], 0.0
    for i in range(30):
        prompt = int(rng.integers(300, 1500))
        cached = int(rng.choice([0, prompt - int(rng.integers(10, 200))]))
        n = prompt - cached
        ttft = 0.12 + (0.04 if n > 256 else 0.0) + 1.5 * BASE_CM.prefill_time(n, cached)
        out = int(rng.integers(8, 24))
        itl = 1.25 * BASE_CM.decode_step_time(1, int(prompt + out / 2))
        e2e = ttft + itl * (out - 1)
        rows.append({"request_id": f"c1-{i}", "send_s": t, "ttft_ms": 1000 * ttft, "itl_ms": 1000 * itl,
                     "e2e_ms": 1000 * e2e, "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": out,
                     "warmup": False, "error": None})
        t += e2e + 0.05
    prof = from_bench_runs([_write_run(tmp_path, rows)], base_profile(), local_prefill_max_tokens=256)
    cm = prof.cost_model()
    assert cm.request_overhead_s == pytest.approx(0.12, rel=1e-3)
    assert cm.disagg_overhead_s == pytest.approx(0.04, rel=1e-3)
    assert cm.prefill_per_token_s == pytest.approx(1.5e-3, rel=1e-3)
    assert cm.decode_per_ctx_token_s == pytest.approx(1.25e-5, rel=1e-3)
    assert prof.source["kind"] == "bench-fit"


def test_bench_fit_needs_requests_that_ran_alone(tmp_path):
    rows = [{"request_id": str(i), "send_s": 0.0, "ttft_ms": 100.0, "itl_ms": 10.0, "e2e_ms": 500.0,
             "prompt_tokens": 100, "cached_tokens": 0, "output_tokens": 10, "warmup": False, "error": None}
            for i in range(10)]  # all at once: every TTFT overlaps another request
    with pytest.raises(ValueError, match="ran alone"):
        from_bench_runs([_write_run(tmp_path, rows)])
    with pytest.raises(ValueError, match="no requests.jsonl"):
        from_bench_runs([tmp_path / "nowhere"])


def test_time_engine_measures_the_reference_engine():
    prof = time_engine("tiny", prefill_grid=((64, 0), (64, 64)), decode_grid=((1, 64), (2, 64)), reps=1,
                       decode_steps=3, host_sizes=(64, 128), progress=False)
    assert [(p.new_tokens, p.context) for p in prof.prefill] == [(64, 0), (64, 64)]
    assert all(p.seconds > 0 for p in prof.prefill) and all(d.seconds > 0 for d in prof.decode)
    assert prof.state["bytes_per_token"] == 2 * (128 + 32) * 4  # tiny: 2 MLA layers of 160 fp32 values
    assert prof.transfer["host"]["gbps"] > 0
    assert prof.cost_model().prefill_time(64) > 0
