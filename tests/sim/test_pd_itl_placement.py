"""``benchmarks/pd_itl.py``'s placement split: where a disaggregated request's co-runners come from.

The script records, for each disaggregated request, whether its decode worker had
decodes at routing while another decode worker had none, and the decode workers
idle when its state arrived. The tests replay small P/D traces through the
script's own simulator construction and check those records against the
simulator's workers, read independently at the same moments.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sim.test_pd_itl_oracle import BENCH, _trace


def _sim(tmp_path: Path, policy: str, decode: int):
    import pd_itl

    trace = tmp_path / "t.jsonl"
    _trace(trace, sessions=24, turns=4)
    return pd_itl, pd_itl.trace_sim(str(trace), ["--block-size", "64", "--prefill", "1", "--decode", str(decode),
                                                 "--concurrency", "6"], policy, None)


@pytest.mark.parametrize("policy", ["state_aware", "round_robin"])
def test_placement_matches_the_workers_at_route_and_at_join(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           policy: str) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    pd_itl, sim = _sim(tmp_path, policy, decode=3)
    info = pd_itl.instrument(sim)
    decoders = [w for w in sim.workers.values() if w.role == "decode"]
    expect_route: dict[str, bool] = {}
    expect_join: dict[str, tuple[int, int]] = {}
    inner_route, inner_start = sim.router.route, sim._start_decode

    def route(req, states):  # read before the decision; the script reads after it (routing moves no decode)
        counts = {w.worker_id: w.batch_size + len(w.decode_wait) for w in decoders}
        d = inner_route(req, states)
        if d.prefill_worker is not None and d.prefill_worker != d.decode_worker:
            expect_route[req.request_id] = counts[d.decode_worker] > 0 and min(counts.values()) == 0
        return d

    def start(job, w, now):
        if job.rid in expect_route:
            idle = [x for x in decoders if not x.batch_size and not x.decode_wait]
            expect_join[job.rid] = (len(idle), sum(x.node_id == w.node_id for x in idle))
        inner_start(job, w, now)

    sim.router.route, sim._start_decode = route, start
    res = sim.run()
    assert sum(r.finish >= 0 for r in res.records) == 96
    assert any(expect_route.values()) and not all(expect_route.values()), "the trace exercises both outcomes"
    for rid, busy in expect_route.items():
        assert info[rid]["busy_at_route"] is busy
        assert (info[rid]["idle_at_join"], info[rid]["idle_on_node"]) == expect_join[rid]
    assert not any(i.get("busy_at_route") for rid, i in info.items() if rid not in expect_route)


def test_placement_summary_with_one_decode_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One decode worker is never passed over for an idle one, and is idle at a join exactly when
    the request found no batch there."""
    monkeypatch.syspath_prepend(str(BENCH))
    pd_itl, sim = _sim(tmp_path, "round_robin", decode=1)
    out = pd_itl.run(sim, "round_robin")
    pl = out["all"]["placement"]
    assert pl["n"] > 0
    assert pl["busy_at_route"] == 0.0
    assert pl["idle_at_join"] == pytest.approx(1.0 - pl["busy_at_join"])
    assert pl["idle_on_node"] == pytest.approx(pl["idle_at_join"])
