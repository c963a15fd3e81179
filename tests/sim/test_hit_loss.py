"""``benchmarks/hit_loss.py``: the gap between a run's reuse and the capacity bound, split into
placement (the state was held somewhere at arrival) and eviction (held nowhere).

Small traces through the script's own replay: its per-request bound sums to the simulator's
``capacity_bound``; a run with room for everything loses nothing to eviction; under capacity
pressure the split adds up and knowing when sessions end (``--know end``) raises the hit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.tools.sim.bound import capacity_bound

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _trace(path: Path, sessions: int = 16) -> None:
    """Sessions of one shared 8-block prefix, growing by 6 blocks a turn, of 6 and 4 turns in turn
    (so some end while others think), 2 s of think time."""
    rows, nxt = [], 1000
    for s in range(sessions):
        ctx = list(range(8))
        for t in range(6 if s % 2 else 4):
            ctx = ctx + list(range(nxt, nxt + 6))
            nxt += 6
            rows.append({"session_id": f"s{s}", "turn": t, "timestamp": 50 * s, "delay": 2000 if t else 0,
                         "input_length": 64 * len(ctx), "output_length": 16, "hash_ids": list(ctx)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


TIGHT = "--block-size 64 --workers 2 --workers-per-node 2 --concurrency 4 --device-blocks 60 --host-blocks 400"


@pytest.fixture
def hit_loss(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import hit_loss

    return hit_loss


def test_the_split_adds_up_to_the_bound(tmp_path: Path, hit_loss) -> None:
    import pd_itl

    trace = tmp_path / "t.jsonl"
    _trace(trace)
    roomy = hit_loss.main(["--trace", str(trace), "--sim-args", TIGHT.split(" --device")[0], "--json"])
    assert roomy["requests"] == 80
    assert roomy["eviction_loss"] == pytest.approx(0.0, abs=1e-9)  # default tiers hold the whole trace
    sim = pd_itl.trace_sim(str(trace), TIGHT.split(), "state_aware", None)
    given = sim.cluster
    hit_loss.watch(sim)
    assert sim.cluster.explain_misses and not given.explain_misses, "the caller's config is left as it was"
    res = sim.run()
    done = sorted((r for r in res.records if r.finish >= 0), key=lambda r: r.arrival)
    assert capacity_bound(sim.requests, res.records, sim.cluster, sim.cost, 4) > 0
    out = hit_loss.split(sim, 4)
    assert out["eviction_loss"] > 0.05  # the tiers are too small for the trace
    assert out["hit_vs_bound"] + out["placement_loss"] + out["eviction_loss"] == pytest.approx(1.0)
    assert all(r.reach_tokens >= r.cached_tokens for r in done)  # one node's tiers, no peer reads


def test_knowing_session_ends_is_worth_hit_under_pressure(tmp_path: Path, hit_loss) -> None:
    """Recency keeps an ended session's state (the newest) over a thinking session's.

    One worker, so placement takes no part and the runs differ in what their tiers evict (0.782
    against 0.834 of the bound when written; with two workers the gap moved with the router's
    weights)."""
    trace = tmp_path / "t.jsonl"
    _trace(trace)
    one = TIGHT.replace("--workers 2 --workers-per-node 2", "--workers 1 --workers-per-node 1")
    plain = hit_loss.main(["--trace", str(trace), "--sim-args", one, "--json"])
    told = hit_loss.main(["--trace", str(trace), "--sim-args", one, "--know", "end", "--json"])
    assert told["know"] == ["end"]
    assert plain["placement_loss"] == pytest.approx(0.0, abs=1e-9)  # one worker: nothing misplaced
    assert told["hit_vs_bound"] > plain["hit_vs_bound"] + 0.04, (plain, told)


def test_bad_knowledge_is_refused(tmp_path: Path, hit_loss) -> None:
    trace = tmp_path / "t.jsonl"
    _trace(trace, sessions=2)
    with pytest.raises(SystemExit):
        hit_loss.main(["--trace", str(trace), "--know", "future"])
    with pytest.raises(SystemExit):
        hit_loss.main(["--trace", str(trace), "--sim-args", "--block-size 64 --retention lru", "--know", "end"])


def test_a_suite_cell_is_the_suites_own_run(hit_loss) -> None:
    """A router suite cell (``member/workers/mode``) replays the run the suite scores: the same
    hit over the same capacity bound, at the suite's default retention (serving's)."""
    import router_suite

    sc = router_suite.Scale(0.25, 0.5, 3.0, 2.0, "checkpoints")
    row = router_suite.run_one((router_suite.Cell("chat_burst", 16, "agg"), "state_aware", sc))
    out = hit_loss.main(["chat_burst/16/agg", "--json"])
    assert out["requests"] == row["requests"]
    assert out["hit_vs_bound"] == pytest.approx(row["cached_tokens"] / row["bound_tokens"], rel=1e-12)
    with pytest.raises(SystemExit):  # a cell or a trace, not both
        hit_loss.main(["chat_burst/16/agg", "--trace", "t.jsonl"])
