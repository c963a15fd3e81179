"""The simulator's replay follows the benchmark's closed and open loops."""

from __future__ import annotations

import random

import pytest

from disagg.costs.model import CostModel
from disagg.tools.bench.runner import RunConfig
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.simulator import ClusterConfig, Simulator
from disagg.tools.sim.workload import SimRequest, shared_ids

HAND = CostModel(prefill_base_s=0.01, prefill_per_token_s=0.001, prefill_attn_s=0.0,
                 decode_base_s=0.02, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0)
BS = 64


def session(sid: str, start_ms: float, lens: list[int], delays: list[float], first_id: int) -> list[SimRequest]:
    out, ids = [], [0, 1]  # two shared prefix blocks
    for turn, (n, d) in enumerate(zip(lens, delays, strict=True)):
        while len(ids) < -(-n // BS):
            ids.append(first_id + len(ids))
        out.append(SimRequest(sid, turn, d, start_ms + 1000 * turn, n, 3, list(ids), BS))
    return out


def trace() -> list[SimRequest]:
    return session("a", 0, [200, 300, 400], [0, 4000, 500], 100) + session("b", 10, [250, 260], [0, 100], 200)


def test_closed_loop_think_times_cap_and_scale():
    cfg = ReplayConfig(concurrency=1, think_cap_ms=1000, think_scale=0.5)
    res = Simulator(trace(), "round_robin", ClusterConfig(num_workers=1), HAND, replay=cfg).run()
    recs = res.records
    assert [(r.session_id, r.turn) for r in recs] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    # a request takes a + b * n (prefill) + 2 decode steps; the next is sent min(delay, cap) * scale later
    expected, t = [], 0.0
    for r, think in zip(recs, [0.0, 0.5, 0.25, 0.0, 0.05], strict=True):
        t += think
        expected.append(t)
        t += 0.01 + 0.001 * (r.prompt_len - r.cached_tokens) + 2 * 0.02
    assert [r.arrival for r in recs] == pytest.approx(expected)


def test_sample_start_turn_draws_what_the_benchmark_draws():
    cfg = ReplayConfig(concurrency=2, sample_start_turn=True, seed=7)
    res = Simulator(trace(), "round_robin", ClusterConfig(num_workers=2), HAND, replay=cfg).run()
    firsts = {r.lane: r for r in res.records if r.warmup}
    for lane, turns in ((0, 3), (1, 2)):
        assert firsts[lane].turn == random.Random(7 * 1_000_003 + lane).randrange(turns)
    assert sum(r.warmup for r in res.records) == 2


def test_bounds_and_recycling_salts():
    cfg = ReplayConfig(concurrency=1, recycle=True, max_requests=7, run_salt=3)
    reqs = trace()
    res = Simulator(reqs, "round_robin", ClusterConfig(num_workers=1), HAND, replay=cfg,
                    shared_ids=shared_ids(reqs)).run()
    assert len(res.records) == 7
    assert [r.salt for r in res.records] == [3 << 16] * 5 + [(3 << 16) | 1] * 2
    second = res.records[5]  # session a replayed with a new salt: only the shared prefix is cached
    assert second.session_id == "a" and second.cached_tokens == 0  # no checkpoint at the prefix end
    assert second.theoretical_tokens == 2 * BS


def test_open_loop_sends_at_timestamps():
    cfg = ReplayConfig(mode="open", speedup=2.0)
    res = Simulator(trace(), "round_robin", ClusterConfig(num_workers=2), HAND, replay=cfg).run()
    assert sorted(r.arrival for r in res.records) == pytest.approx([0.0, 0.005, 0.5, 0.505, 1.0])


def test_replay_config_from_the_benchmark_and_errors():
    rc = RunConfig(concurrency=4, max_requests=40, think_cap_ms=2000, think_scale=0.05, sample_start_turn=True,
                   run_salt=2, seed=5, ramp_s=1.5)
    cfg = ReplayConfig.from_run_config(rc)
    assert (cfg.concurrency, cfg.max_requests, cfg.think_cap_ms, cfg.think_scale, cfg.sample_start_turn,
            cfg.run_salt, cfg.seed, cfg.ramp_s) == (4, 40, 2000, 0.05, True, 2, 5, 1.5)
    with pytest.raises(ValueError, match="recycling"):
        ReplayConfig(recycle=True)
    with pytest.raises(ValueError, match="mode"):
        ReplayConfig(mode="burst")
