"""Router domains (cluster slices in processes) and the configuration sweep."""

from __future__ import annotations

import pytest

from disagg.costs.model import CostModel
from disagg.tools.bench.synth import synthesize
from disagg.tools.sim.cli import main as sim_main
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.shard import simulate, split_cluster, split_requests
from disagg.tools.sim.simulator import ClusterConfig
from disagg.tools.sim.sweep import SweepPoint, SweepRow, best, grid, parse_pd, run_sweep
from disagg.tools.sim.workload import from_trace_records

COST = CostModel(max_decode_batch=32)


def trace(n: int = 24):
    return from_trace_records(synthesize(n, 1, block_size=256, scale=0.1, turn_scale=0.1), 256)


def test_domains_split_sessions_and_engines():
    reqs = trace()
    parts = split_requests(reqs, 3)
    assert sum(map(len, parts)) == len(reqs)
    fams = [{r.parent_session or r.session_id for r in p} for p in parts]
    assert not (fams[0] & fams[1]) and not (fams[1] & fams[2])  # a session family stays in one slice
    assert split_cluster(ClusterConfig(num_prefill=4, num_decode=8), 4).num_decode == 2
    with pytest.raises(ValueError, match="equal domains"):
        split_cluster(ClusterConfig(num_workers=6), 4)


def test_domains_in_processes_give_the_same_records_as_in_one():
    reqs = trace()
    cl = ClusterConfig(num_workers=4, workers_per_node=2)
    rp = ReplayConfig(concurrency=6)
    one = simulate(reqs, "state_aware", cl, COST, rp, domains=2, jobs=1)
    two = simulate(reqs, "state_aware", cl, COST, rp, domains=2, jobs=2)
    key = [(r.request_id, r.first_token, r.finish, r.prefill_worker) for r in one.records]
    assert key == [(r.request_id, r.first_token, r.finish, r.prefill_worker) for r in two.records]
    assert one.summary["requests"] == len(reqs) and one.summary["domains"] == 2
    assert one.num_gpus == 4 and one.router_metrics["num_decisions"] == len(reqs)


def test_sweep_reads_fronts_at_the_target_and_picks_the_best():
    reqs = trace(8)
    points = grid([2], ["agg", "1:1"], [0], ["state_aware"])
    rows = run_sweep(reqs, points, [2, 8], ClusterConfig(workers_per_node=4), COST, ReplayConfig(concurrency=1),
                     target=5.0, usd_per_gpu_hour=2.0, progress=False)
    assert [len(r.runs) for r in rows] == [2] * 2
    for r in rows:
        assert r.at_target is not None and r.tokens_per_dollar == pytest.approx(r.at_target * 3600 / 2.0)
    assert best(rows) is max(rows, key=lambda r: r.at_target)
    assert SweepPoint(4, "1:3", 0, "x").cluster(ClusterConfig()).num_prefill == 1


def test_best_skips_rows_that_miss_the_target():
    a = SweepRow(SweepPoint(1, "agg", 0, "a"), at_target=None)
    b = SweepRow(SweepPoint(2, "agg", 0, "b"), at_target=10.0, tokens_per_dollar=5.0)
    assert best([a, b]) is b and best([a]) is None
    with pytest.raises(ValueError, match="P:D"):
        parse_pd("3-1")


def test_cli_sweep_prints_the_best_configuration(capsys):
    assert sim_main(["sim", "sweep", "--agentic", "12", "--scale", "0.1", "--turn-scale", "0.1",
                     "--engines", "2", "--pd", "agg,1:1", "--host-blocks", "0,4096", "--concurrency", "2,6",
                     "--target", "5", "--gpu-cost", "h200"]) == 0
    out = capsys.readouterr().out
    assert "best at 5 tok/s/user P90" in out and "tokens per dollar" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["2"]]
    assert sorted((r[1], r[2]) for r in rows) == [("1:1", "0"), ("1:1", "4096"), ("agg", "0"), ("agg", "4096")]
