"""Where the simulator's lost reuse went (``ClusterConfig.explain_misses``, Simulator NOTE 10;
``metrics.reuse_lost``; ``disagg sim run --explain-misses``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.tools.sim.cli import main as sim_main
from disagg.tools.sim.metrics import (
    CHECKPOINT_KINDS,
    LOST,
    RequestRecord,
    checkpoint_use,
    reuse_lost,
)
from disagg.tools.sim.simulator import ClusterConfig, Simulator
from disagg.tools.sim.workload import SimRequest, SynthConfig, synth_sessions


def _rec(theory: int, cached: int, reach: int, stored: int, evicted: bool) -> RequestRecord:
    r = RequestRecord("r", "s", 0, 2000, 8, 0.0, theoretical_tokens=theory, cached_tokens=cached,
                      reach_tokens=reach, stored_tokens=stored, gap_stored_before=evicted)
    r.finish = 1.0
    return r


def test_each_requests_lost_reuse_goes_to_one_place_by_where_it_stopped():
    records = [
        _rec(1000, 600, 800, 900, True),  # 200 placement, 100 checkpoint, 100 evicted
        _rec(500, 0, 0, 0, False),  # 500 in flight
        _rec(100, 150, 100, 100, False),  # resumed past the bound: nothing lost, nothing negative
        _rec(400, 0, 0, 0, True),  # not measured (below): left out
    ]
    records[3].reach_tokens = -1
    lost = reuse_lost(records)
    assert lost == pytest.approx({"lost_placement": 200 / 1600, "lost_checkpoint": 100 / 1600,
                                  "lost_evicted": 100 / 1600, "lost_in_flight": 500 / 1600})
    assert reuse_lost(records[3:]) == {}, "nothing measured: no shares"


def _shares_and_resumed(res) -> tuple[float, float]:
    done = [r for r in res.records if r.finish >= 0]
    theory = sum(r.theoretical_tokens for r in done)
    return sum(res.summary[k] for k in LOST), sum(min(r.cached_tokens, r.theoretical_tokens) for r in done) / theory


def test_explaining_changes_no_placement_and_the_shares_add_up():
    """Tight tiers, so reuse is lost: the explained run places and times every request as the plain
    run does, and what it resumed plus the four shares is the whole infinite-cache figure."""
    reqs = synth_sessions(SynthConfig(num_sessions=16, turns=5), seed=3)
    plain = ClusterConfig(num_workers=4, workers_per_node=2, device_blocks=48, host_blocks=64)
    explained = replace(plain, explain_misses=True)
    a = Simulator(reqs, "state_aware", plain, lanes=8, seed=1).run()
    b = Simulator(reqs, "state_aware", explained, lanes=8, seed=1).run()
    assert not set(LOST) & set(a.summary) and not any(k.startswith("ckpt_") for k in a.summary)
    assert {k: v for k, v in b.summary.items() if k not in LOST and not k.startswith("ckpt_")} == a.summary
    assert [(r.decode_worker, r.cached_tokens, r.first_token) for r in a.records] == \
        [(r.decode_worker, r.cached_tokens, r.first_token) for r in b.records]
    lost, resumed = _shares_and_resumed(b)
    assert lost > 0.05, "tiers this small lose reuse"
    assert lost + resumed == pytest.approx(1.0)
    assert b.summary["lost_evicted"] > 0


def test_a_prefix_still_computing_is_in_flight_and_one_without_a_resume_point_is_checkpoint():
    """Two sessions send the same 9-block prefix. Sent together, the second cannot resume what the
    first is still computing (in flight). Sent a quarter second apart, the blocks are stored but the
    first prompt's resume point is at its end, block 9, past what the second may resume of a prompt
    that ends there too (it computes at least its last token): checkpoint. Nothing is evicted."""
    ids = list(range(9))

    def second(stagger: float, plen: int):
        reqs = [SimRequest("s0", 0, 0, 0, 2304, 4, ids, 256), SimRequest("s1", 0, 0, 0, plen, 4, ids + [99], 256)]
        res = Simulator(reqs, "round_robin", ClusterConfig(num_workers=2, explain_misses=True), lanes=2,
                        lane_stagger_s=stagger).run()
        assert res.summary["lost_evicted"] == 0
        return res, next(r for r in res.records if r.session_id == "s1")

    res, rec = second(0.0, 2560)
    assert (rec.theoretical_tokens, rec.cached_tokens, rec.reach_tokens, rec.stored_tokens) == (2304, 0, 0, 0)
    assert not rec.gap_stored_before and res.summary["lost_in_flight"] > 0
    res, rec = second(0.25, 2304)
    assert (rec.theoretical_tokens, rec.cached_tokens, rec.reach_tokens, rec.stored_tokens) == (2303, 0, 0, 2304)
    assert res.summary["lost_checkpoint"] == 1.0 and res.summary["lost_in_flight"] == 0


def test_the_cli_prints_where_reuse_was_lost(capsys):
    argv = ["sim", "run", "--sessions", "12", "--turns", "4", "--workers", "4", "--device-blocks", "32",
            "--host-blocks", "512", "--policy", "state_aware", "--explain-misses"]
    assert sim_main(argv) == 0
    out = capsys.readouterr().out
    assert "share of the tokens an infinite cache would have resumed, lost to:" in out
    lost, kinds = out.split("lost to:")[1].split("checkpoints by the rule that kept them")
    row = next(line for line in lost.splitlines() if line.startswith("state_aware"))
    shares = [float(x) for x in row.split()[1:]]
    assert len(shares) == 5 and shares[-1] == pytest.approx(sum(shares[:4]), abs=2e-3) and shares[-1] > 0
    head = next(line for line in kinds.splitlines() if line.startswith("checkpoints"))
    assert head.split()[1:] == list(CHECKPOINT_KINDS)
    row = next(line for line in kinds.splitlines() if line.startswith("state_aware"))
    cells = [tuple(x.strip() for x in part.split("/")) for part in row.removeprefix("state_aware").split("  ") if "/" in part]
    assert len(cells) == len(CHECKPOINT_KINDS)
    assert sum(float(c[2]) for c in cells) == pytest.approx(1.0, abs=3e-3), "the kinds share every resumed token"
    assert int(cells[0][0]) > 0, "the engine keeps checkpoints at every prompt end"


def _kept(rid: str, kept: tuple[str, ...], cached: int = 0, resumed_from: str = "") -> RequestRecord:
    r = RequestRecord(rid, "s", 0, 2000, 8, 0.0, cached_tokens=cached, reach_tokens=0, kept=kept,
                      resumed_from=resumed_from)
    r.finish = 1.0
    return r


def test_checkpoint_use_counts_each_kind_kept_and_resumed_from():
    records = [_kept("a", ("engine", "start", "start")), _kept("b", ("engine", "branch"), 600, "start"),
               _kept("c", ("engine",), 1800, "branch"), _kept("d", (), 0, "")]
    use = checkpoint_use(records)
    assert (use["ckpt_kept_engine"], use["ckpt_kept_start"], use["ckpt_kept_branch"], use["ckpt_kept_back"]) == (3, 2, 1, 0)
    assert (use["ckpt_resumes_start"], use["ckpt_resumes_branch"], use["ckpt_resumes_engine"]) == (1, 1, 0)
    assert use["ckpt_tokens_start"] == pytest.approx(0.25) and use["ckpt_tokens_branch"] == pytest.approx(0.75)
    records[0].reach_tokens = records[1].reach_tokens = records[2].reach_tokens = records[3].reach_tokens = -1
    assert checkpoint_use(records) == {}, "nothing measured: no figures"


def test_every_resume_is_credited_to_the_rule_that_kept_its_checkpoint():
    """A shared system prompt and multi-turn sessions, with serving's learned placement: every
    resume of the explained run names one kind, the resumes add up to the requests that resumed,
    and the shared prompt's sessions resume at its branch point."""
    cfg = SynthConfig(num_sessions=24, turns=4)
    reqs = synth_sessions(cfg, seed=5)
    cluster = ClusterConfig(num_workers=4, workers_per_node=2, learned_checkpoints=True,
                            checkpoint_every_blocks=0, explain_misses=True)
    res = Simulator(reqs, "state_aware", cluster, lanes=8, seed=1).run()
    done = [r for r in res.records if r.finish >= 0]
    resumed = [r for r in done if r.cached_tokens]
    assert resumed and all(r.resumed_from in CHECKPOINT_KINDS for r in resumed)
    assert sum(res.summary[f"ckpt_resumes_{k}"] for k in CHECKPOINT_KINDS) == len(resumed)
    assert sum(res.summary[f"ckpt_tokens_{k}"] for k in CHECKPOINT_KINDS) == pytest.approx(1.0)
    assert res.summary["ckpt_resumes_branch"] > 0, "later sessions resume the shared prompt at its branch point"
    for k in CHECKPOINT_KINDS:  # a kind resumed from was kept
        assert res.summary[f"ckpt_resumes_{k}"] == 0 or res.summary[f"ckpt_kept_{k}"] > 0
