from __future__ import annotations

import dataclasses
import json

import pytest

from disagg.costs.model import CostModel
from disagg.costs.profile import cost_profile
from disagg.router.types import RouteRequest
from disagg.tools.sim.bound import capacity_bound_per_request
from disagg.tools.sim.cache import LRUTier
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.simulator import ClusterConfig, Simulator
from disagg.tools.sim.state import PromptState
from disagg.tools.sim.workload import (
    SimRequest,
    SynthConfig,
    consecutive_reuse,
    from_mooncake_records,
    synth_sessions,
)

HAND = CostModel(prefill_base_s=0.01, prefill_per_token_s=0.001, prefill_attn_s=0.0,
                 decode_base_s=0.02, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0)


def test_hand_computed_ttft_and_itl():
    r = SimRequest("s", 0, 0, 0, 1000, 5, list(range(4)), 256)
    res = Simulator([r], "round_robin", ClusterConfig(num_workers=1), HAND).run()
    rec = res.records[0]
    assert rec.ttft == pytest.approx(0.01 + 1000 * 0.001)  # a + b * n
    assert rec.itl == pytest.approx(0.02)  # 4 more tokens, one decode step each
    assert rec.finish == pytest.approx(1.01 + 4 * 0.02)


def test_second_turn_resumes_from_checkpoint():
    ids = list(range(8))
    t0 = SimRequest("s", 0, 0, 0, 1000, 2, ids[:4], 256)  # 3 full blocks -> ckpt at 768
    t1 = SimRequest("s", 1, 0, 0, 2048, 2, ids[:3] + [50, 51, 52, 53, 54], 256)
    # one worker: where the turn goes is the router's business (a node mate may read the host tier)
    res = Simulator([t0, t1], "state_aware", ClusterConfig(num_workers=1), HAND).run()
    second = res.records[1]
    assert (second.cached_tokens, second.theoretical_tokens, second.cached_tier) == (768, 768, "device")
    assert second.ttft == pytest.approx(0.01 + (2048 - 768) * 0.001)
    assert res.router_metrics["prediction_ratio"] == 1.0


def test_simulation_is_deterministic_for_a_seed():
    reqs = synth_sessions(SynthConfig(num_sessions=12, turns=4), seed=7)
    runs = [Simulator(reqs, p, ClusterConfig(num_workers=4), lanes=6, seed=1).run()
            for p in ("state_aware", "state_aware", "power_of_two", "power_of_two")]
    assert runs[0].summary == runs[1].summary
    assert runs[2].summary == runs[3].summary
    assert [r.decode_worker for r in runs[0].records] == [r.decode_worker for r in runs[1].records]


def test_pd_cluster_transfers_state():
    reqs = synth_sessions(SynthConfig(num_sessions=6, turns=3), seed=2)
    res = Simulator(reqs, "state_aware", ClusterConfig(num_prefill=2, num_decode=2), lanes=6).run()
    assert res.summary["requests"] == len(reqs)
    assert any(r.prefill_worker != r.decode_worker for r in res.records)
    assert all(r.decode_worker in ("w02", "w03") for r in res.records)


def test_open_loop_and_tiers():
    reqs = synth_sessions(SynthConfig(num_sessions=6, turns=3), seed=2)
    cl = ClusterConfig(num_workers=4, workers_per_node=2, device_blocks=64, host_blocks=128, disk_blocks=4096)
    res = Simulator(reqs, "state_aware", cl, mode="open").run()
    assert res.summary["requests"] == len(reqs)
    assert {r.cached_tier for r in res.records} - {None, "device", "host", "disk"} == set()


def test_lru_tier_eviction_order_and_events():
    log = []
    t = LRUTier("device", 3, lambda op, key: log.append((op, key)))
    for d in (b"a", b"b", b"c"):
        t.put(d)
    t.touch(b"a")
    assert t.put(b"k", 2) == [b"b", b"c"]
    assert log[-3:] == [("evicted", b"b"), ("evicted", b"c"), ("stored", b"k")]
    assert t.put(b"big", 4) is None and t.used == 3
    assert t.keys() == [b"a", b"k"]


def test_lru_tier_put_many_refreshes_and_survives_self_eviction():
    t = LRUTier("device", 3)
    t.put_many([b"a", b"b", b"c"])
    t.put_many([b"d", b"a"])  # inserting d evicts b (LRU), then a is refreshed
    assert t.keys() == [b"c", b"d", b"a"]
    t.put_many([b"x", b"y", b"c"])  # x evicts c, y evicts d, c must be re-inserted (evicting a)
    assert t.keys() == [b"x", b"y", b"c"] and t.used == 3
    assert t.present([b"x", b"a"]) == [True, False]


def test_synthetic_sessions_reuse_and_mooncake_conversion():
    reqs = synth_sessions(SynthConfig(num_sessions=8, turns=10), seed=0)
    assert 0.93 <= consecutive_reuse(reqs) <= 0.99
    assert reqs == synth_sessions(SynthConfig(num_sessions=8, turns=10), seed=0)
    rec = {"session_id": "s7", "turn": 3, "timestamp": 41250, "delay": 8000,
           "input_length": 1030, "output_length": 219, "hash_ids": [0, 1, 2]}
    (r,) = from_mooncake_records([rec], block_size=512)
    assert (r.session_id, r.turn, r.delay_ms, r.num_full_blocks, r.output_length) == ("s7", 3, 8000.0, 2, 219)


def test_cost_model_profiles(tmp_path):
    p = tmp_path / "prof.json"
    p.write_text(json.dumps({"decode_base_s": 0.03, "bandwidth_gbps": {"host": 10, "disk": 1, "remote": 2}}))
    cm = cost_profile(str(p))
    assert cm.decode_step_time(1, 0) == pytest.approx(0.03 + 1e-4)
    assert cm.transfer_time(10e9, "host") == pytest.approx(1.0 + 50e-6)
    assert cost_profile("large").prefill_per_token_s > cost_profile("small").prefill_per_token_s
    with pytest.raises(ValueError):
        CostModel.from_dict({"nope": 1})


def test_cli_run_with_a_profile_and_the_bench_summary(capsys):
    from disagg.tools.sim.cli import main as sim_main

    assert sim_main(["sim", "run", "--agentic", "6", "--scale", "0.1", "--turn-scale", "0.1", "--profile",
                     "h200-small", "--workers", "2", "--concurrency", "3", "--bench", "--gpu-cost", "h200"]) == 0
    out = capsys.readouterr().out
    assert "state_aware (simulated)" in out and "tokens/$" in out and "P90 interactivity" in out


def test_cli_calibrate_from_saved_engine_figures(tmp_path, capsys):
    from pathlib import Path

    from disagg.costs.profile import load_profile
    from disagg.tools.sim.cli import main as sim_main

    h200 = Path(__file__).resolve().parents[2] / "docs" / "perf" / "h200-2026-11-29"
    out = tmp_path / "h200.json"
    assert sim_main(["sim", "calibrate", "--from-engine-bench", str(h200 / "engine_fla.json"), "--transfer",
                     str(h200 / "transfer.json"), "--name", "mine", "-o", str(out)]) == 0
    assert "max error" in capsys.readouterr().out
    assert load_profile(out).name == "mine"
    assert sim_main(["sim", "calibrate"]) == 2


def test_hand_computed_disaggregated_request():
    """P != D: first token at prefill end + publish (host link) + disagg overhead; decode after the load."""
    cost = CostModel(prefill_base_s=0.01, prefill_per_token_s=0.001, prefill_attn_s=0.0, decode_base_s=0.02,
                     decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, bytes_per_token=1000.0,
                     checkpoint_bytes=1e6, bandwidth_gbps={"host": 1.0, "disk": 1.0, "remote": 0.5},
                     latency_s={"host": 0.0, "remote": 0.0}, request_overhead_s=0.1, disagg_overhead_s=0.05)
    r = SimRequest("s", 0, 0, 0, 4000, 5, list(range(16)), 256)
    cl = ClusterConfig(num_prefill=1, num_decode=1, workers_per_node=1)  # P and D on different nodes
    res = Simulator([r], "round_robin", cl, cost).run()
    rec = res.records[0]
    state = (4000 * 1000.0 + 1e6) / 1e9
    prefill_end = 0.1 + 0.01 + 4000 * 0.001
    assert (rec.prefill_worker, rec.decode_worker) == ("w00", "w01")
    assert rec.first_token == pytest.approx(prefill_end + state / 1.0 + 0.05)
    assert rec.finish == pytest.approx(rec.first_token + state / 0.5 + 4 * 0.02)  # remote load, 4 more tokens
    assert rec.ttft == pytest.approx(rec.first_token)  # sent at 0


def test_a_decode_worker_reports_a_request_inbound_from_routing_to_arrival():
    """P/D: the decode worker's report counts the request (and its prompt tokens) as inbound from the
    routing, through the pool's prefill and the hand-off, and as running once it arrives, as a
    serving decode worker, which takes the request first, reports it (``WorkerState``)."""
    cost = CostModel(prefill_base_s=0.01, prefill_per_token_s=0.001, prefill_attn_s=0.0, decode_base_s=0.02,
                     decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0)
    r = SimRequest("s", 0, 0, 0, 4000, 5, list(range(16)), 256)
    sim = Simulator([r], "round_robin", ClusterConfig(num_prefill=1, num_decode=1, workers_per_node=1), cost)
    d = sim.workers["w01"].state
    seen: list[tuple[float, int, int, int]] = []
    for name in ("prefill_done", "_arrive_decode", "finish"):
        real = getattr(sim, name)

        def spy(*args, _real=real, _name=name):
            seen.append((_name, d.inbound_decode_requests, d.inbound_decode_tokens, d.running_decode_requests))
            return _real(*args)

        setattr(sim, name, spy)
    rec = sim.run().records[0]
    assert (rec.prefill_worker, rec.decode_worker) == ("w00", "w01")
    assert seen[0] == ("prefill_done", 1, 4000, 0)  # in the pool: inbound, not running
    assert seen[1] == ("_arrive_decode", 1, 4000, 0)  # the hand-off lands
    assert seen[2] == ("finish", 0, 0, 1)  # decoded there
    assert (d.inbound_decode_requests, d.inbound_decode_tokens) == (0, 0)


def test_a_hand_off_loads_only_what_the_decode_device_lacks():
    """The decode worker's device holds the first 10 blocks of the prompt (an earlier turn decoded
    there): the hand-off moves the other 6 blocks and the checkpoint (NOTE 2)."""
    cost = CostModel(prefill_base_s=0.01, prefill_per_token_s=0.001, prefill_attn_s=0.0, decode_base_s=0.02,
                     decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, bytes_per_token=1000.0,
                     checkpoint_bytes=1e6, bandwidth_gbps={"host": 1.0, "disk": 1.0, "remote": 0.5},
                     latency_s={"host": 0.0, "remote": 0.0})
    r = SimRequest("s", 0, 0, 0, 4000, 5, list(range(16)), 256)
    cl = ClusterConfig(num_prefill=1, num_decode=1, workers_per_node=1)
    sim = Simulator([r], "round_robin", cl, cost)
    digests = sim.digests.digests("s", 0, r.hash_ids, 16)
    sim.workers["w01"].device.put_many(digests[:10])
    rec = sim.run().records[0]
    moved = ((4000 - 10 * 256) * 1000.0 + 1e6) / 1e9
    assert rec.finish == pytest.approx(rec.first_token + moved / 0.5 + 4 * 0.02)


def test_engines_of_a_node_share_its_compute():
    """Processor sharing: with one compute slot per node, two busy engines progress at half speed each."""
    a = SimRequest("a", 0, 0, 0, 1000, 1, list(range(4)), 256)
    b = SimRequest("b", 0, 0, 0, 1000, 1, list(range(10, 14)), 256)
    shared = ClusterConfig(num_workers=2, workers_per_node=2, node_compute_slots=1.0)
    res = Simulator([a, b], "round_robin", shared, HAND, lanes=2, lane_stagger_s=0.0).run()
    assert sorted(r.ttft for r in res.records) == pytest.approx([2 * 1.01, 2 * 1.01])
    apart = ClusterConfig(num_workers=2, workers_per_node=1, node_compute_slots=1.0)  # one engine per node
    res = Simulator([a, b], "round_robin", apart, HAND, lanes=2, lane_stagger_s=0.0).run()
    assert [r.ttft for r in res.records] == pytest.approx([1.01, 1.01])
    loaded = ClusterConfig(num_workers=2, workers_per_node=2, node_compute_slots=0.5)  # a loaded machine
    res = Simulator([a, b], "round_robin", loaded, HAND, lanes=2, lane_stagger_s=0.0).run()
    assert sorted(r.ttft for r in res.records) == pytest.approx([4 * 1.01, 4 * 1.01])
    res = Simulator([a], "round_robin", loaded, HAND, lanes=1).run()
    assert res.records[0].ttft == pytest.approx(1.01)  # alone: as timed


def test_compute_sharing_charges_the_overlap_to_both_steps():
    """A short step started under a long one: both run at half speed while they overlap, then the long one at
    full speed again (a factor fixed when a step starts would charge the whole overlap to the short one)."""
    long_ = SimRequest("a", 0, 0, 0, 1000, 1, list(range(4)), 256)  # 1.01 s alone
    short = SimRequest("b", 0, 0, 0, 100, 1, [10], 256)  # 0.11 s alone, sent at 0.5
    shared = ClusterConfig(num_workers=2, workers_per_node=2, node_compute_slots=1.0)
    res = Simulator([long_, short], "round_robin", shared, HAND, lanes=2, lane_stagger_s=0.5).run()
    ttft = {r.session_id: r.ttft for r in res.records}
    assert ttft["b"] == pytest.approx(2 * 0.11)  # 0.5 -> 0.72 at half speed
    assert ttft["a"] == pytest.approx(0.72 + (1.01 - 0.5 - 0.11))  # 0.61 of its cost done at 0.72
    assert res.records[0].prefill_worker != res.records[1].prefill_worker
    big = ClusterConfig(num_workers=2, workers_per_node=2, node_compute_slots=2.0)  # enough for both
    res = Simulator([long_, short], "round_robin", big, HAND, lanes=2, lane_stagger_s=0.5).run()
    assert sorted(r.ttft for r in res.records) == pytest.approx([0.11, 1.01])


def test_compute_sharing_cuts_macro_decode_steps_by_work_done():
    """Decode as one macro event or step by step gives the same records under compute sharing."""
    # a decodes on w00 from 0.31 s (one macro step); b (w01, 0.35 s) slows it until b's prefill ends and the
    # lane sends c (w00), which cuts a's macro step by the work it has done; d (w01, 0.7 s) slows c's prefill
    reqs = [SimRequest(s, 0, 0, 0, n, out, list(range(10 * i, 10 * i + 2)), 256)
            for i, (s, n, out) in enumerate([("a", 300, 60), ("b", 100, 1), ("c", 200, 20), ("d", 400, 25)])]
    out = []
    for macro in (1, 64):
        cl = ClusterConfig(num_workers=2, workers_per_node=2, node_compute_slots=1.3, macro_steps=macro)
        res = Simulator(reqs, "round_robin", cl, HAND, lanes=4, lane_stagger_s=0.35).run()
        out.append(sorted((r.session_id, r.first_token, r.finish) for r in res.records))
    for x, y in zip(*out, strict=True):
        assert x[0] == y[0] and x[1:] == pytest.approx(y[1:], rel=1e-9, abs=1e-9)
    # by hand: a's decode runs 0.04 s alone, then at 1.3 / 2 while b's 0.11 s prefill runs; c arrives as b ends,
    # with 0.15 s (7.5 steps) of a's decode done: the 8th ends 0.01 s later, then c's step (0.21 + 0.02 s) runs,
    # at 1.3 / 2 from d's arrival at 0.7 s
    b_end = 0.35 + 0.11 * 2 / 1.3
    c_first = 0.7 + (0.23 - (0.7 - (b_end + 0.01))) * 2 / 1.3
    c = next(x for x in out[1] if x[0] == "c")
    assert c[1] == pytest.approx(c_first)


def test_a_prefill_reads_its_decode_workers_node_when_that_resumes_further():
    """P/D, the pool on node n0, decode workers on n1: a prompt whose state only n1's host tier
    holds resumes there over the remote link (``peer_reads``), charged at the remote bandwidth;
    without peer reads, or when the pool's own tiers resume as far, it reads its own node."""
    reqs = synth_sessions(SynthConfig(num_sessions=1, turns=1, block_size=64), seed=1)
    for peer in (True, False):
        c = ClusterConfig(num_prefill=2, num_decode=2, workers_per_node=2, peer_reads=peer)
        sim = Simulator(reqs, "round_robin", c, lanes=1)
        p, d = sim.workers["w00"], sim.workers["w02"]
        bs = sim.block_size
        digests = list(range(1, 9))
        ps = PromptState([bytes([i]) * 16 for i in digests], 8 * bs + 5, bs, [])
        sim.state.store(ps, 0, LRUTier("device", 64), sim.host[d.node_id])  # only n1's host tier holds it
        got = sim._resume(ps, p, d)
        if not peer:
            assert got.tokens == 0
            continue
        assert (got.tokens, got.tier) == (8 * bs, "remote")
        assert got.load_s == pytest.approx(sim.cost.transfer_time(got.nbytes, "remote"))
        sim.state.store(ps, 0, p.device, sim.host[p.node_id])  # now the pool's node holds it too
        assert sim._resume(ps, p, d).tier == "device"
        assert sim._resume(ps, p, p).tokens == 8 * bs  # a local prefill reads its own node


def _pd_sim(**cluster) -> tuple[Simulator, PromptState]:
    """A P/D simulator of three nodes of two workers (the pool w00, w01 on n0; decode workers on
    n1, n2) and an 8-block prompt (plus a 5-token tail) none of its tiers holds yet."""
    reqs = synth_sessions(SynthConfig(num_sessions=1, turns=1, block_size=64), seed=1)
    sim = Simulator(reqs, "round_robin", ClusterConfig(num_prefill=2, num_decode=4, workers_per_node=2, **cluster),
                    lanes=1)
    bs = sim.block_size
    return sim, PromptState([bytes([i]) * 16 for i in range(1, 9)], 8 * bs + 5, bs, [])


def test_a_target_reads_the_node_the_router_names_when_that_resumes_further():
    """A moved session: the router names its last node (``RouteDecision.state_node``, router step 4).
    The target, a local prefill on its decode worker or a pool prefill, reads that node's host tier
    over the remote link when it resumes further than its own tiers; unnamed, or without peer reads,
    it reads its own node."""
    for peer in (True, False):
        sim, ps = _pd_sim(peer_reads=peer)
        p, d, old = sim.workers["w00"], sim.workers["w02"], sim.workers["w04"]
        bs = sim.block_size
        sim.state.store(ps, 0, LRUTier("device", 64), sim.host[old.node_id])  # only n2's host tier holds it
        assert sim._resume(ps, d, d).tokens == sim._resume(ps, p, d).tokens == 0  # nothing named
        for target in (d, p):
            got = sim._resume(ps, target, d, old.node_id)
            assert (got.tokens, got.tier) == ((8 * bs, "remote") if peer else (0, None))


def test_peer_read_credit_sends_a_decode_nodes_sessions_to_the_pool_at_the_same_reuse():
    """The pool on node n0, decode workers on n1, n2, tiers too small for the pool to keep every
    session: a turn whose state only its decode worker's node still holds is prefilled there
    (``local_state``); with the router's ``peer_reads`` credit it goes to the pool, which reads
    that node's host tier over the remote link: the same tokens reused, as the router predicted."""
    reqs = synth_sessions(SynthConfig(num_sessions=8, turns=4, system_tokens=512, first_user_tokens=4096,
                                      think_s=1.0), seed=3)
    c = ClusterConfig(num_prefill=2, num_decode=4, workers_per_node=2, device_blocks=24, host_blocks=96,
                      retention="session")
    runs = {}
    for credit in (False, True):
        res = Simulator(reqs, "state_aware", c, lanes=2, router_config={"peer_reads": credit}).run()
        runs[credit] = [r for r in res.records if r.finish >= 0]
    assert len(runs[False]) == len(runs[True]) == len(reqs)
    assert any(r.reason.startswith("local_state") for r in runs[False])
    far = [r for r in runs[True] if r.cached_tier == "remote"]
    assert far and not any(r.reason.startswith("local_state") for r in runs[True])
    assert all(r.reason.startswith("disagg") and r.prefill_worker in ("w00", "w01") for r in far)
    assert all(r.predicted_tokens == r.cached_tokens > 0 for r in far)
    assert sum(r.cached_tokens for r in runs[True]) == sum(r.cached_tokens for r in runs[False])


def test_spill_to_pool_moves_a_decode_nodes_evictions_to_a_prefill_nodes_host_tier():
    """``spill_to_pool`` (Simulator NOTE 4): the pool on n0, decode workers on n1 and n2. What n1's
    host tier evicts lands in n0's host tier, where the index sees it and a prefill worker there
    resumes it from its own node (tier "host"); without the flag it is gone. The pool's own host
    tier keeps plain eviction. Written through: with victim host tiers (the default) the pool's
    node mate would read the session from the device the first resume loaded it into."""
    for spill in (True, False):
        sim, ps = _pd_sim(host_blocks=128, spill_to_pool=spill, host_write="through")
        p, d = sim.workers["w00"], sim.workers["w02"]
        bs = sim.block_size
        sim.state.store(ps, 0, LRUTier("device", 64), sim.host[d.node_id])  # 8 blocks + a checkpoint on n1
        assert sim._resume(ps, p, p).tokens == 0
        sim.host[d.node_id].put(b"filler", 128)  # evicts the session from n1's host tier
        assert sim.host[d.node_id].keys() == [b"filler"]
        got = sim._resume(ps, p, p)
        assert (got.tokens, got.tier) == ((8 * bs, "host") if spill else (0, None))
        assert (sim.index.resumable(RouteRequest("q", "s", ps.full(), ps.prompt_len, bs), "w00")[0] == 8 * bs) \
            is spill
        mate = sim.workers["w01"]  # p's node mate: its device is empty, it reads n0's host tier
        sim.host[p.node_id].put(b"filler", 128)  # the pool's own evictions go nowhere
        assert sim.host[p.node_id].keys() == [b"filler"] and sim._resume(ps, mate, mate).tokens == 0


def test_spill_to_pool_passes_demoted_objects_by():
    """What the retention demoted (cache NOTE 4) and the decode node then evicts unread is not
    spilled: the pool's host tier gets the session's other objects only. The host -> disk
    write-behind still takes demoted objects."""
    sim, ps = _pd_sim(host_blocks=128, spill_to_pool=True)
    d, pool = sim.workers["w02"], sim.host["n0"]
    host = sim.host[d.node_id]
    sim.state.store(ps, 0, LRUTier("device", 64), host)
    held = host.keys()
    demoted = held[-3:]
    host.demote(demoted)
    host.put(b"filler", 128)
    assert sorted(pool.keys()) == sorted(k for k in held if k not in demoted)
    sim, ps = _pd_sim(host_blocks=128, disk_blocks=128, spill_to_pool=True)
    d = sim.workers["w02"]
    host = sim.host[d.node_id]
    sim.state.store(ps, 0, LRUTier("device", 64), host)
    held = host.keys()
    host.demote(held)
    host.put(b"filler", 128)
    assert sorted(sim.disk[d.node_id].keys()) == sorted(held)


def test_spill_to_pool_leaves_a_disk_tier_first_in_line():
    """With a disk tier the decode node's host evictions go to its disk (state NOTE 3); what the
    disk evicts goes to the pool node's host tier (even while the disk is empty: no truthiness)."""
    sim, ps = _pd_sim(host_blocks=128, disk_blocks=128, spill_to_pool=True)
    p, d = sim.workers["w00"], sim.workers["w02"]
    bs = sim.block_size
    sim.state.store(ps, 0, LRUTier("device", 64), sim.host[d.node_id])
    sim.host[d.node_id].put(b"filler", 128)
    assert len(sim.disk[d.node_id]) > 0 and len(sim.host[p.node_id]) == 0  # on n1's disk, not yet in the pool
    sim.disk[d.node_id].put(b"filler", 128)
    got = sim._resume(ps, p, p)
    assert (got.tokens, got.tier) == (8 * bs, "host")


def _ephemeral_session(turns: int, bs: int = 64) -> list[SimRequest]:
    """Each prompt: the context so far, then 2 blocks of reminders and 10 tokens the next one drops."""
    out, ctx, nxt = [], list(range(10)), 1000
    for t in range(turns):
        eph = [nxt, nxt + 1, nxt + 2]
        nxt += 3
        out.append(SimRequest("s", t, 0.0, 0.0, (len(ctx) + 2) * bs + 10, 2, ctx + eph, bs))
        ctx = ctx + list(range(nxt, nxt + 4))  # the next turn keeps the context and adds 4 blocks
        nxt += 4
    return out


def test_learned_placement_resumes_where_follow_ups_diverge():
    """Serving's learned placement (disagg.reuse.placement) keeps a checkpoint where the next turn
    drops the previous prompt's tail; the engine's own points alone (prompt end, last full block)
    are past it, so every follow-up would recompute."""
    reqs = _ephemeral_session(6)
    runs = {}
    for learned in (False, True):
        cluster = ClusterConfig(num_workers=1, checkpoint_every_blocks=0, checkpoint_prompt_end=True,
                                learned_checkpoints=learned)
        runs[learned] = Simulator(reqs, "round_robin", cluster, HAND).run().records
    diverged = [len(r.hash_ids) - 3 for r in reqs[:-1]]  # blocks of context each follow-up keeps
    assert [r.cached_tokens for r in runs[False][1:]] == [0] * 5
    assert [r.cached_tokens for r in runs[True][1:]] == [n * 64 for n in diverged]
    assert all(r.theoretical_tokens == n * 64 for r, n in zip(runs[True][1:], diverged, strict=True))


def _tail_dropping_sessions(sessions: int, turns: int, tail: int, bs: int = 64) -> list[SimRequest]:
    """``sessions`` sessions one after another (open loop); each prompt is the context so far, ``tail``
    blocks of reminders and 10 tokens that the next prompt drops, so every follow-up diverges ``tail``
    blocks back from its predecessor's last full block."""
    out = []
    for s in range(sessions):
        ctx, nxt = list(range(s * 100_000, s * 100_000 + 10)), s * 100_000 + 1000
        for t in range(turns):
            eph = list(range(nxt, nxt + tail + 1))
            nxt += tail + 1
            out.append(SimRequest(f"s{s}", t, 0.0, s * 100_000.0 + t * 5_000.0, (len(ctx) + tail) * bs + 10, 2,
                                  ctx + eph, bs))
            ctx = ctx + list(range(nxt, nxt + 4))
            nxt += 4
    return out


def test_router_learned_divergence_reaches_workers_that_saw_none():
    """The state-aware router learns where follow-ups diverge from every session it routes and names
    it in each decision (disagg.router.divergence); a worker's own placement learns only from the
    follow-ups it served. Sessions after the first land on workers that saw none: with the router's
    distances their first follow-ups resume exactly where they diverge; with each worker's own cold
    prior (1, 2, 4 blocks back) a 3-block tail resumes a block short."""
    reqs = _tail_dropping_sessions(4, 4, tail=3)
    cluster = ClusterConfig(num_workers=4, checkpoint_every_blocks=0, checkpoint_prompt_end=True,
                            learned_checkpoints=True)
    runs = {}
    for hints in (False, True):
        res = Simulator(reqs, "state_aware", cluster, HAND, router_config={"checkpoint_hints": hints},
                        replay=ReplayConfig(mode="open")).run()
        runs[hints] = sorted(res.records, key=lambda r: (r.session_id, r.turn))
    later = [(r, q) for r, q in zip(runs[True], reqs, strict=True) if q.session_id != "s0" and q.turn > 0]
    assert len({r.decode_worker for r in runs[True]}) > 1  # sessions spread: workers that saw no follow-up
    assert all(r.cached_tokens == r.theoretical_tokens > 0 for r, _ in later)
    without = [r for r in runs[False] if r.session_id != "s0" and r.turn > 0]
    assert sum(r.cached_tokens for r in without) < sum(r.cached_tokens for r, _ in later)


def test_write_back_host_tiers_hold_what_devices_evicted():
    """NOTE 6: with ``host_write="back"`` a turn's store goes to the device only and the node's host
    tier receives what the device evicts; written through, the host holds the turn at once. A
    prefill's hand-off still publishes to its node's host tier (the decode worker loads it there)."""
    a = SimRequest("a", 0, 0, 0, 1000, 2, list(range(4)), 256)  # 3 full blocks
    b = SimRequest("b", 0, 0, 0, 2048, 2, list(range(10, 18)), 256)  # 8 full blocks: the device, after a
    held = {}
    for write in ("through", "back"):
        cl = ClusterConfig(num_workers=1, device_blocks=8, host_blocks=1000, checkpoint_every_blocks=0,
                           checkpoint_last_full_block=False, host_write=write)
        sim = Simulator([a, b], "round_robin", cl, HAND, lanes=1)
        sim.run()
        da = sim.digests.digests("a", 0, a.hash_ids, 4)[:3]
        db = sim.digests.digests("b", 0, b.hash_ids, 8)
        dev, host = sim.workers["w00"].device, sim.host["n0"]
        held[write] = (dev.present(da), host.present(da), dev.present(db), host.present(db))
    t, f = [True], [False]
    assert held["through"] == (f * 3, t * 3, t * 8, t * 8)
    assert held["back"] == (f * 3, t * 3, t * 8, f * 8)  # a's blocks reached the host as b pushed them out
    r = SimRequest("s", 0, 0, 0, 4000, 5, list(range(16)), 256)
    cl = ClusterConfig(num_prefill=1, num_decode=1, workers_per_node=1, host_write="back")
    sim = Simulator([r], "round_robin", cl, HAND)
    sim.run()
    full = sim.digests.digests("s", 0, r.hash_ids, 16)[:15]
    assert all(sim.host["n0"].present(full)) and not any(sim.host["n1"].present(full))
    with pytest.raises(ValueError):
        ClusterConfig(host_write="around")


def test_victim_host_tiers_resume_from_a_node_mates_device():
    """NOTE 12: with ``host_write="victim"`` a host tier too small for a session lets its blocks go
    while a device of the node holds them, and the next turn, placed on the other worker of the
    node, resumes them from that device; written through, the host tier kept only the session's
    newest blocks and the turn recomputes. In P/D only the decode workers' devices count. Without
    a host tier, victim (the default) is through. "victim-own" (serving's ``transfer.host.victim``) keeps the same
    tiers but reads no node mate's device, and tells the index of the host tier alone."""
    a0 = SimRequest("a", 0, 0, 0, 2048 + 100, 2, list(range(9)), 256)  # 8 full blocks
    a1 = SimRequest("a", 1, 0, 0, 3072 + 100, 2, list(range(13)), 256)  # extends a0's blocks
    got = {}
    for write in ("through", "victim", "victim-own"):
        cl = ClusterConfig(num_workers=2, workers_per_node=2, device_blocks=64, host_blocks=6,
                           checkpoint_every_blocks=0, host_write=write)
        sim = Simulator([a0, a1], "round_robin", cl, HAND, lanes=1)
        recs = sorted(sim.run().records, key=lambda r: r.turn)
        got[write] = [(r.decode_worker, r.cached_tokens) for r in recs]
        if write.startswith("victim"):
            assert (sim.victims["n0"].publish is None) == (write == "victim-own")
    assert got["through"] == [("w00", 0), ("w01", 0)]
    assert got["victim"] == [("w00", 0), ("w01", 2048)]
    assert got["victim-own"] == [("w00", 0), ("w01", 0)], "the node mate's device is not read"
    # P/D: only decoding devices count; the prefill node's device holds the prompt, not the session
    r = SimRequest("s", 0, 0, 0, 4000, 5, list(range(16)), 256)
    sim = Simulator([r], "round_robin", ClusterConfig(num_prefill=1, num_decode=1, workers_per_node=1,
                                                      host_write="victim"), HAND)
    sim.run()
    full = sim.digests.digests("s", 0, r.hash_ids, 16)[:15]
    assert all(sim.workers["w00"].device.present(full)) and all(sim.workers["w01"].device.present(full))
    assert not any(k in sim.victims["n0"].held for k in full)
    assert all(sim.victims["n1"].held[k] == 1 for k in full)
    assert ClusterConfig(host_blocks=0).host_write == "through", "no host tier to keep apart: through"
    assert ClusterConfig().host_write == "victim", "the default, as serving's on the reference engine"


def test_victim_host_tiers_read_no_prefill_mates_device():
    """NOTE 12: a P/D prefill worker's device answers no recall (serving's ``disagg.workers.holds``
    NOTE 4), so a prefill worker does not resume what its prefill mate's device holds: of two
    questions on one document, the second, sent to the other prefill worker of the node, recomputes
    the document there when the node's host tier cannot keep it (the decode worker on another node,
    peer reads off)."""
    doc = list(range(16))  # 16 blocks of 256 shared by both prompts
    q0 = SimRequest("q0", 0, 0, 0, 16 * 256 + 300, 2, doc + [100, 101], 256)
    q1 = SimRequest("q1", 0, 0, 0, 16 * 256 + 300, 2, doc + [200, 201], 256)
    cl = ClusterConfig(num_prefill=2, num_decode=1, workers_per_node=2, device_blocks=512, host_blocks=1,
                       peer_reads=False, host_write="victim")
    sim = Simulator([q0, q1], "round_robin", cl, HAND, lanes=1)  # q1 is sent when q0 has ended
    recs = sorted(sim.run().records, key=lambda r: r.arrival)
    assert [r.prefill_worker for r in recs] == ["w00", "w01"]
    shared = sim.digests.digests("q0", 0, q0.hash_ids, 256)[:16]
    assert all(sim.workers["w00"].device.present(shared)), "the first prefill's device still holds the document"
    assert [r.cached_tokens for r in recs] == [0, 0], "not read from the prefill mate's device"
    host, _ = sim._node_tiers_of(sim.workers["w01"])
    assert host.devices == [], "the node's only other device is a prefill worker's"


def _sharing_pair(gap_ms: float, busy: bool = False) -> list[SimRequest]:
    """Two sessions whose first prompts share 16 blocks of 256 (a periodic checkpoint at 4096),
    the second sent ``gap_ms`` after the first; ``busy``: behind a third session's prompt."""
    shared = list(range(16))
    pair = [SimRequest("a", 0, 0, 1.0, 5120, 1, shared + [100, 101, 102, 103], 256),
            SimRequest("b", 0, 0, 1.0 + gap_ms, 5120, 1, shared + [200, 201, 202, 203], 256)]
    return [SimRequest("c", 0, 0, 0.0, 2048, 1, list(range(300, 308)), 256), *pair] if busy else pair


def test_a_prefill_queued_behind_its_prefix_resumes_it_when_admitted():
    """Simulator NOTE 8: B, sent while A computes the prefix they share on the one worker, planned
    nothing at routing; its first step comes after A's prefill stored the prefix, and the engine's
    look at its device then resumes it (the capacity bound looks it up there too)."""
    reqs = _sharing_pair(500.0)
    sim = Simulator(reqs, "round_robin", ClusterConfig(num_workers=1), HAND, mode="open")
    res = sim.run()
    a, b = sorted(res.records, key=lambda r: r.arrival)
    assert a.cached_tokens == 0 and a.admitted == pytest.approx(a.arrival)
    assert b.admitted == pytest.approx(a.first_token)  # the step after A's prefill, not its arrival
    assert (b.cached_tokens, b.cached_tier) == (4096, "device")
    assert b.first_token == pytest.approx(a.first_token + 0.01 + (5120 - 4096) * 0.001)
    bound = capacity_bound_per_request(reqs, res.records, sim.cluster, sim.cost, 0)
    assert bound == [0, 4096]


def test_a_prefill_that_starts_beside_its_prefix_does_not_resume_it():
    """Queued together behind a third prompt, A and B get their first chunks in one step (the
    chunk budget holds both): nothing is stored when B is admitted, so it computes the prefix too,
    in the run and in the bound."""
    reqs = _sharing_pair(1.0, busy=True)
    sim = Simulator(reqs, "round_robin", ClusterConfig(num_workers=1), HAND, mode="open")
    res = sim.run()
    c, a, b = sorted(res.records, key=lambda r: r.arrival)
    assert a.admitted == b.admitted == pytest.approx(c.first_token)
    assert [r.cached_tokens for r in (c, a, b)] == [0, 0, 0]
    assert capacity_bound_per_request(reqs, res.records, sim.cluster, sim.cost, 0) == [0, 0, 0]


def test_a_pd_prefix_is_resumable_from_its_store_before_the_hand_off_returns():
    """P/D: the pool's prefill stores A's state before A's first token comes back (the publish and
    the hand-off's overhead). B, queued behind A on the one prefill worker, is admitted right at
    that store and resumes the prefix, and the capacity bound counts it ready from the store too,
    so the run does not beat its own bound."""
    cost = CostModel(prefill_base_s=0.01, prefill_per_token_s=0.001, prefill_attn_s=0.0, decode_base_s=0.02,
                     decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, disagg_overhead_s=0.05)
    reqs = _sharing_pair(500.0)
    sim = Simulator(reqs, "round_robin", ClusterConfig(num_prefill=1, num_decode=1), cost, mode="open")
    res = sim.run()
    a, b = sorted(res.records, key=lambda r: r.arrival)
    assert a.prefill_worker == b.prefill_worker == "w00"
    assert a.stored < a.first_token and b.admitted == pytest.approx(a.stored)
    assert b.cached_tokens == 4096
    assert capacity_bound_per_request(reqs, res.records, sim.cluster, sim.cost, 0) == [0, 4096]


def test_a_prefill_left_no_room_in_a_step_is_looked_up_when_it_starts():
    """Beside a running decode the step's budget (8192 - 1) leaves A's single chunk of 8,000 tokens
    191 to spare, too few for a block of B's: B starts in the next step, after A stored the prefix,
    and that is when the engine looks its device up (not in the step it had no room in)."""
    shared = list(range(16))
    reqs = [SimRequest("c", 0, 0, 0.0, 256, 1000, [900], 256),  # decodes throughout
            SimRequest("a", 0, 0, 300.0, 8000, 1, shared + list(range(100, 116)), 256),
            SimRequest("b", 0, 0, 300.1, 5120, 1, shared + [200, 201, 202, 203], 256)]
    sim = Simulator(reqs, "round_robin", ClusterConfig(num_workers=1), HAND, mode="open")
    res = sim.run()
    _, a, b = sorted(res.records, key=lambda r: r.arrival)
    assert a.admitted < b.admitted == pytest.approx(a.stored)
    assert (b.cached_tokens, b.cached_tier) == (4096, "device")


def test_chunk_cache_lets_a_prefill_admitted_later_resume_a_running_one():
    """Simulator NOTE 11: with a 2048-token chunk budget A's 5120-token prompt takes three steps;
    B, queued behind it, gets its first chunk in A's last step. With chunks cached as they
    complete (vLLM's prefix caching) the device then holds A's first 4096 tokens and the
    checkpoint at their end, which B shares: it resumes them. Without, nothing of A is stored
    when B starts, and B computes the prefix too. The capacity bound sees the chunk from its end
    on, so the run does not beat it."""
    cost = dataclasses.replace(HAND, max_prefill_tokens_per_step=2048)
    reqs = _sharing_pair(10.0)
    out = {}
    for cached in (False, True):
        sim = Simulator(reqs, "round_robin", ClusterConfig(num_workers=1, chunk_cache=cached), cost, mode="open")
        res = sim.run()
        a, b = sorted(res.records, key=lambda r: r.arrival)
        bound = capacity_bound_per_request(reqs, res.records, sim.cluster, sim.cost, 0)
        out[cached] = (a, b, bound)
        assert b.admitted > a.admitted and b.admitted < a.stored  # B starts beside A's last chunk
        assert a.cached_tokens == 0
    a, b, bound = out[False]
    assert b.cached_tokens == 0 and bound == [0, 0] and a.chunks is None
    a, b, bound = out[True]
    assert [n for _, n in a.chunks] == [8, 16]  # two chunks of 2048 tokens before its end
    assert (b.cached_tokens, b.cached_tier) == (4096, "device")
    assert bound == [0, 4096]
    assert b.first_token < out[False][1].first_token  # B computed 4096 tokens fewer
