"""``benchmarks/pd_itl.py --oracle-spread``: the bound on what decode placement alone can do.

The oracle replaces a disaggregated request's decode worker by the one with the
fewest requests routed to it and not finished; the test replays a small P/D
trace through the script's own simulator construction and checks that every
disaggregated decision it lets through went to such a worker, that decode-local
decisions kept theirs, and that the count returns to zero when the run ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _trace(path: Path, sessions: int = 10, turns: int = 4) -> None:
    rows, nxt = [], 1
    for s in range(sessions):
        ctx = list(range(nxt, nxt + 20))
        nxt += 20
        for t in range(turns):
            rows.append({"session_id": f"s{s}", "turn": t, "timestamp": 100 * s, "delay": 500 if t else 0,
                         "input_length": 64 * len(ctx), "output_length": 40, "hash_ids": list(ctx)})
            ctx = ctx + list(range(nxt, nxt + 4))
            nxt += 4
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("policy", ["state_aware", "round_robin"])
def test_oracle_spread_picks_the_least_busy_decode_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          policy: str) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import pd_itl

    trace = tmp_path / "t.jsonl"
    _trace(trace)
    sim = pd_itl.trace_sim(str(trace), ["--block-size", "64", "--prefill", "1", "--decode", "3",
                                        "--concurrency", "8"], policy, None)
    decoders = [w for w, x in sim.workers.items() if x.role == "decode"]
    live = dict.fromkeys(decoders, 0)
    seen = {"disagg": 0, "local": 0}
    picks: list = []  # what the policy decided, before the oracle

    def route(req, states, inner=sim.router.route):
        picks.append(inner(req, states))
        return picks[-1]

    sim.router.route = route
    pd_itl.spread_decodes(sim)
    oracle_route, oracle_finish = sim.router.route, sim.finish

    def outer(req, states):
        before = dict(live)
        d = oracle_route(req, states)
        policy_pick = picks[-1]
        if d.prefill_worker is not None:
            seen["disagg"] += 1
            assert before[d.decode_worker] == min(before.values())
            if before[policy_pick.decode_worker] == min(before.values()):
                assert d.decode_worker == policy_pick.decode_worker  # ties keep the policy's pick
        else:
            seen["local"] += 1
            assert d.decode_worker == policy_pick.decode_worker
        live[d.decode_worker] += 1
        owners[req.request_id] = d.decode_worker
        return d

    def finish(job, w, now):
        live[owners.pop(job.rid)] -= 1
        oracle_finish(job, w, now)

    owners: dict[str, str] = {}
    sim.router.route, sim.finish = outer, finish
    res = sim.run()
    assert sum(r.finish >= 0 for r in res.records) == 40
    assert seen["disagg"] > 0
    assert set(live.values()) == {0}


def test_oracle_spread_refuses_an_aggregated_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import pd_itl

    trace = tmp_path / "t.jsonl"
    _trace(trace, sessions=2, turns=1)
    sim = pd_itl.trace_sim(str(trace), ["--block-size", "64", "--workers", "2"], "round_robin", None)
    with pytest.raises(SystemExit, match="P/D cluster"):
        pd_itl.spread_decodes(sim)


@pytest.mark.parametrize("policy", ["state_aware", "round_robin"])
def test_oracle_spread_by_tokens_takes_the_reported_least_loaded_decode_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """``--oracle-spread --oracle-by tokens``: a disaggregated request decodes where the decode workers report the
    fewest decode tokens (running and inbound) when it is routed; a decode-local one keeps its worker."""
    monkeypatch.syspath_prepend(str(BENCH))
    import pd_itl

    trace = tmp_path / "t.jsonl"
    _trace(trace)
    sim = pd_itl.trace_sim(str(trace), ["--block-size", "64", "--prefill", "1", "--decode", "3",
                                        "--concurrency", "8"], policy, None)
    picks: list = []

    def route(req, states, inner=sim.router.route):
        picks.append(inner(req, states))
        return picks[-1]

    sim.router.route = route
    pd_itl.spread_decodes(sim, "tokens")
    oracle_route = sim.router.route
    seen = {"moved": 0, "disagg": 0, "local": 0}

    def outer(req, states):
        load = {s.worker_id: s.running_decode_tokens + s.inbound_decode_tokens for s in states if s.role == "decode"}
        d = oracle_route(req, states)
        if d.prefill_worker is not None:
            seen["disagg"] += 1
            assert load[d.decode_worker] == min(load.values())
            seen["moved"] += d.decode_worker != picks[-1].decode_worker
            if load[picks[-1].decode_worker] == min(load.values()):
                assert d.decode_worker == picks[-1].decode_worker  # ties keep the policy's pick
        else:
            seen["local"] += 1
            assert d.decode_worker == picks[-1].decode_worker
        return d

    sim.router.route = outer
    res = sim.run()
    assert sum(r.finish >= 0 for r in res.records) == 40
    assert seen["disagg"] > 0 and seen["moved"] > 0  # it did replace picks
    with pytest.raises(ValueError, match="spread by"):
        pd_itl.spread_decodes(sim, "requests")


def test_oracle_spread_by_overlap_hides_outputs_from_the_policy(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``--oracle-by overlap``: the policy is never told an output length (neither when it routes nor
    when it is told of the decision), and each disaggregated request decodes where it shares the fewest
    decode steps: min(its output, each unfinished co-runner's tokens still to generate), counted here
    from the workers' batches."""
    monkeypatch.syspath_prepend(str(BENCH))
    import pd_itl

    trace = tmp_path / "t.jsonl"
    _trace(trace)
    sim = pd_itl.trace_sim(str(trace), ["--block-size", "64", "--prefill", "1", "--decode", "3",
                                        "--concurrency", "8"], "state_aware", None)
    hints: list[int] = []
    inner_route, inner_note = sim.router.route, sim.router.on_routed

    def route(req, states):
        hints.append(req.output_len_hint)
        return inner_route(req, states)

    def note(req, d):
        hints.append(req.output_len_hint)
        inner_note(req, d)

    sim.router.route, sim.router.on_routed = route, note
    given = sim.cluster
    pd_itl.spread_decodes(sim, "overlap")
    assert sim.cluster.output_hint == "exact" and given.output_hint == "none", "the caller's config stays"
    oracle_route, oracle_finish = sim.router.route, sim.finish
    output = {}  # request id -> output length, as the trace gives it
    where: dict[str, str] = {}
    seen = {"disagg": 0}

    def shared(wid: str, own: int) -> int:
        w = sim.workers[wid]
        rest = {job.rid: end - w.steps for end, _, job in w._batch}
        return sum(min(own, rest.get(rid, output[rid])) for rid, o in where.items() if o == wid)

    def outer(req, states):
        own = req.output_len_hint
        assert own > 0  # the oracle is told
        before = {wid: shared(wid, own) for wid in sim.workers if sim.workers[wid].role == "decode"}
        d = oracle_route(req, states)
        output[req.request_id] = own
        if d.prefill_worker is not None:
            seen["disagg"] += 1
            assert before[d.decode_worker] == min(before.values())
        where[req.request_id] = d.decode_worker
        return d

    def finish(job, w, now):
        where.pop(job.rid, None)
        oracle_finish(job, w, now)

    sim.router.route, sim.finish = outer, finish
    res = sim.run()
    assert sum(r.finish >= 0 for r in res.records) == 40
    assert seen["disagg"] > 0
    assert hints and set(hints) == {0}
