"""Metrics, server counters, cost presets and Pareto fronts against hand-computed values."""

from __future__ import annotations

import math

import pytest

from disagg.tools.bench.client import RequestResult
from disagg.tools.bench.cost import gpu_hour_price, tokens_per_dollar, usd_per_million_tokens
from disagg.tools.bench.metrics import SLO, percentile, summarize
from disagg.tools.bench.pareto import (
    best_meeting,
    compare_fronts,
    front_at,
    monotone_interpolate,
    pareto_front,
    steffen_slopes,
)
from disagg.tools.bench.servermetrics import cache_delta, parse_prometheus

MS = 1_000_000


def _req(
    send_ms: float,
    ttft: float,
    itl: float,
    out: int,
    *,
    prompt: int = 100,
    cached: int = 0,
    error: str | None = None,
    warmup: bool = False,
) -> RequestResult:
    send = int(send_ms * MS)
    chunks = [send + int((ttft + i * itl) * MS) for i in range(out)]
    return RequestResult(
        "r",
        send,
        chunks[0],
        chunks[-1],
        chunks,
        out,
        prompt,
        cached,
        200 if error is None else 500,
        error,
        warmup=warmup,
        input_length=prompt,
    )


def test_percentiles_are_linear_interpolation() -> None:
    values = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert percentile(values, 90) == pytest.approx(91.0)
    assert percentile(values, 50) == pytest.approx(55.0)
    assert percentile(values, 99) == pytest.approx(99.1)
    assert math.isnan(percentile([], 50))


def test_summary_by_hand() -> None:
    reqs = [
        _req(0, 50, 20, 11, cached=40),
        _req(100, 30, 10, 21, cached=60),
        _req(200, 70, 40, 6, cached=0),
        _req(0, 500, 100, 50, warmup=True),
    ]
    s = summarize(reqs, num_gpus=2, slo=SLO(ttft_ms=60, itl_ms=25), usd_per_gpu_hour=1.5)
    assert (s.num_requests, s.num_ok, s.num_warmup) == (3, 3, 1)
    assert s.ttft_ms.mean == pytest.approx(50.0) and s.ttft_ms.p50 == pytest.approx(50.0)
    assert s.itl_ms.p50 == pytest.approx(20.0)
    assert s.itl_ms.p90 == pytest.approx(36.0)  # ITLs 10, 20, 40 -> 20 + 0.8 * 20
    assert s.p90_interactivity == pytest.approx(1000 / 36)
    assert s.e2e_ms.p50 == pytest.approx(250.0)  # E2Es 250 (50+10*20), 230, 270
    window_s = (200 + 270) / 1000  # first send 0 ms, last end 470 ms
    assert s.duration_s == pytest.approx(window_s)
    assert s.total_tps_per_gpu == pytest.approx((300 + 38) / window_s / 2)
    assert s.output_tps_per_gpu == pytest.approx(38 / window_s / 2)
    assert s.uncached_input_tps_per_gpu == pytest.approx(200 / window_s / 2)
    assert s.cache_hit_usage == pytest.approx(100 / 300)
    assert s.goodput_rps == pytest.approx(2 / window_s)  # the 70 ms TTFT request misses
    assert s.tokens_per_dollar == pytest.approx(s.total_tps_per_gpu * 3600 / 1.5)
    assert s.valid


def test_failures_make_a_run_invalid_above_10_percent() -> None:
    good = [_req(i, 10, 1, 3) for i in range(9)]
    assert summarize(good + [_req(9, 10, 1, 3, error="http_5xx")]).valid  # exactly 10%
    s = summarize(
        good[:8] + [_req(9, 10, 1, 3, error="http_5xx"), _req(10, 1, 1, 2, error="timeout")]
    )
    assert not s.valid and s.errors == {"http_5xx": 1, "timeout": 1}
    assert s.failure_rate == pytest.approx(0.2)


def test_cost_presets_and_published_figures() -> None:
    assert tokens_per_dollar(7567, 1.50) / 1e6 == pytest.approx(18.16, abs=0.005)
    assert tokens_per_dollar(6083, 2.26) / 1e6 == pytest.approx(9.69, abs=0.005)
    assert usd_per_million_tokens(7567, 1.50) == pytest.approx(1e6 / 18_160_800)
    assert gpu_hour_price("mi355x") == 1.48
    assert gpu_hour_price("MI355X-neocloud") == 1.90
    assert gpu_hour_price("b300:3yr") == 3.48
    assert gpu_hour_price("h100/hs") == 1.30
    assert gpu_hour_price("1.50") == 1.5 and gpu_hour_price(2.26) == 2.26
    with pytest.raises(ValueError, match="unknown price preset"):
        gpu_hour_price("tpu-v9")
    with pytest.raises(ValueError):
        gpu_hour_price("mi355x-spot")


def test_server_counters_delta_and_absence() -> None:
    before = (
        "# TYPE disagg_prompt_tokens_total counter\n"
        'disagg_prompt_tokens_total{source="device",worker="0"} 100\n'
        'disagg_prompt_tokens_total{source="computed",worker="0"} 50\n'
    )
    after = (
        'disagg_prompt_tokens_total{source="device",worker="0"} 400\n'
        'disagg_prompt_tokens_total{source="device",worker="1"} 100\n'
        'disagg_prompt_tokens_total{source="host",worker="1"} 100\n'
        'disagg_prompt_tokens_total{source="computed",worker="0"} 250\n'
    )
    s = cache_delta(before, after)
    assert s.available and s.tokens_by_source["device"] == 400
    assert s.hit_rate == pytest.approx(500 / 700)
    assert not cache_delta("x 1\n", "x 2\n").available
    assert not cache_delta(None, after).available
    vllm = cache_delta(
        "vllm:prefix_cache_hits_total 1\nvllm:prefix_cache_queries_total 2\n",
        "vllm:prefix_cache_hits_total 31\nvllm:prefix_cache_queries_total 42\n",
    )
    assert vllm.available and vllm.hit_rate == pytest.approx(0.75)
    other = cache_delta(
        before, after.replace("disagg_prompt", "mine_prompt"), counter="mine_prompt_tokens_total"
    )
    assert other.hit_rate == pytest.approx(600 / 850)  # absent before: counted from 0
    assert parse_prometheus('a{l="x\\"y"} 3 1700000000\n')[("a", (("l", 'x\\"y'),))] == 3


POINTS = [
    (20.0, 9000.0),
    (40.0, 7000.0),
    (35.0, 5000.0),
    (60.0, 4000.0),
    (100.0, 1000.0),
    (100.0, 800.0),
]


def test_pareto_front_by_hand() -> None:
    assert pareto_front(POINTS) == [0, 1, 3, 4]  # (35, 5000) is dominated by (40, 7000)
    assert pareto_front([(1, 1), (1, 1)]) == [1] or pareto_front([(1, 1), (1, 1)]) == [0]
    assert pareto_front([(float("nan"), 1), (1, 2)]) == [1]


def test_monotone_interpolation() -> None:
    xs, ys = [20.0, 40.0, 60.0, 100.0], [9000.0, 7000.0, 4000.0, 1000.0]
    for x, y in zip(xs, ys, strict=False):
        assert monotone_interpolate(xs, ys, x) == pytest.approx(y)
    assert monotone_interpolate([0.0, 10.0], [10.0, 0.0], 2.5) == pytest.approx(7.5)  # linear
    grid = [20 + i * 0.5 for i in range(161)]
    vals = [monotone_interpolate(xs, ys, g) for g in grid]
    assert all(
        b <= a + 1e-9 for a, b in zip(vals, vals[1:], strict=False)
    )  # monotone, no overshoot
    assert max(vals) <= 9000 and min(vals) >= 1000
    assert monotone_interpolate(xs, ys, 10) is None and monotone_interpolate(xs, ys, 101) is None
    # Steffen slopes at the interior node 40: secants -100 and -150 -> -2 * min(100, 150, 62.5)
    assert steffen_slopes(xs, ys)[1] == pytest.approx(-125.0)
    at = front_at(POINTS, [30, 50, 150])
    assert 7000 < at[30] < 9000 and 4000 < at[50] < 7000 and at[150] is None


def test_compare_fronts_ratios() -> None:
    a = [(20.0, 1000.0), (80.0, 250.0)]
    b = [(x, 2 * y) for x, y in a]
    rows = compare_fronts(a, b, [30, 50, 150])
    assert rows[0]["ratio"] == pytest.approx(2.0) and rows[1]["ratio"] == pytest.approx(2.0)
    assert rows[2]["a"] is None and rows[2]["ratio"] is None


def test_best_meeting_reads_measured_points_without_interpolation() -> None:
    # at 30 the front (lowest x 20) would interpolate; best_meeting takes (40, 7000), the best point >= 30
    assert best_meeting(POINTS, 30) == 7000.0
    assert best_meeting(POINTS, 10) == 9000.0  # below the front's range: the best point of all
    assert best_meeting(POINTS, 100) == 1000.0 and best_meeting(POINTS, 101) is None
    assert best_meeting([(float("nan"), 5e4), (50.0, 10.0)], 0) == 10.0
