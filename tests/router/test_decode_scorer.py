"""Decode scorer: hand-computed costs and scores, phases, range, registry."""

from __future__ import annotations

import pytest

from disagg.router.context import EffectiveLoad, RoutingContext
from disagg.router.index import MatchResult, PrefixMatch
from disagg.router.registry import SCORERS, build_profile
from disagg.router.scorers.decode import DecodeScorer
from disagg.router.types import RouteRequest, WorkerState

W3 = [WorkerState("a"), WorkerState("b"), WorkerState("c")]
# round numbers: step = 0.01 + 0.001 (B + 1) + 1e-6 (D + prompt); prefill 1000 tok/s
CFG = dict(decode_base_s=0.01, decode_per_seq_s=0.001, decode_per_ctx_token_s=1e-6,
           prefill_tokens_per_s=1000.0, default_output_tokens=100.0)


def _ctx(loads, matches=None, phase="both", prompt_len=1000, hint=0):
    r = RouteRequest("r", "s", [], prompt_len, 4, output_len_hint=hint)
    return RoutingContext(r, MatchResult(matches or {}, 0), dict(zip("abc", loads, strict=True)), phase)


def test_costs_by_hand():
    # a: idle; b: 2 decodes over 2000 tokens, nothing cached; c: the same, 900 of the 1000 tokens cached
    loads = [EffectiveLoad(), EffectiveLoad(decode_tokens=2000, decode_requests=2),
             EffectiveLoad(decode_tokens=2000, decode_requests=2)]
    ctx = _ctx(loads, {"c": PrefixMatch(900, "device", 225)})
    cost, scale = DecodeScorer(**CFG).costs(ctx, W3)
    step_a = 0.01 + 0.001 * 1 + 1e-6 * 1000  # 0.012
    step_bc = 0.01 + 0.001 * 3 + 1e-6 * 3000  # 0.016
    assert cost.tolist() == pytest.approx([100 * step_a, 100 * step_bc + 2 * 1000 / 1000,
                                           100 * step_bc + 2 * 100 / 1000])
    assert scale == pytest.approx(100 * step_a + 1000 / 1000)
    score = DecodeScorer(**CFG).score(ctx, W3)
    assert score["a"] == 1.0
    assert score["b"] == 0.0  # 1 - (3.6 - 1.2) / 2.2 < 0: clipped
    assert score["c"] == pytest.approx(1 - (1.8 - 1.2) / 2.2)
    assert score["b"] < score["c"] < score["a"]


def test_requests_queued_for_prefill_count_as_the_batch_they_will_join():
    """A worker with a long prefill queue and no decodes yet is not the idle one: its queued requests
    join its batch before r does (count_queued); counted by running decodes alone, a would win here."""
    loads = [EffectiveLoad(prefill_tokens=3000, prefill_requests=3), EffectiveLoad(decode_requests=1),
             EffectiveLoad(decode_requests=1, prefill_requests=1)]
    cost, _ = DecodeScorer(**CFG).costs(_ctx(loads), W3)
    step = [0.01 + 0.001 * (b + 1) + 1e-6 * 1000 for b in (3, 1, 2)]
    assert cost.tolist() == pytest.approx([100 * step[0] + 3 * 1.0, 100 * step[1] + 1.0, 100 * step[2] + 2 * 1.0])
    assert DecodeScorer(**CFG).score(_ctx(loads), W3)["b"] == 1.0
    running_only = DecodeScorer(**CFG, count_queued=False).costs(_ctx(loads), W3)[0]
    assert running_only.tolist() == pytest.approx([100 * 0.012, 100 * 0.013 + 1.0, 100 * 0.013 + 1.0])


def test_inbound_decodes_count_as_the_batch_they_will_join():
    """P/D: a decode worker whose requests all still prefill in the pool runs no batch yet, but they
    join it before r does (count_inbound); counted by its running batch alone (the default), a wins."""
    loads = [EffectiveLoad(inbound_decodes=3), EffectiveLoad(decode_requests=1),
             EffectiveLoad(decode_requests=1, inbound_decodes=1)]
    counting = DecodeScorer(**CFG, count_inbound=True)
    cost, _ = counting.costs(_ctx(loads), W3)
    step = [0.01 + 0.001 * (b + 1) + 1e-6 * 1000 for b in (3, 1, 2)]
    assert cost.tolist() == pytest.approx([100 * step[0] + 3 * 1.0, 100 * step[1] + 1.0, 100 * step[2] + 2 * 1.0])
    assert counting.score(_ctx(loads), W3)["b"] == 1.0
    assert DecodeScorer(**CFG).score(_ctx(loads), W3)["a"] == 1.0


# the state hand-off a disaggregated decode waits for: 1000 prompt tokens
XFER = dict(bytes_per_token=1000.0, checkpoint_bytes=0.0, host_gbps=1.0, remote_gbps=0.1, host_latency_s=0.0,
            remote_latency_s=0.0)  # host 1e6 B / 1 GB/s = 1 ms, remote 10 ms


def test_decode_phase_uses_the_hint_and_charges_a_possible_local_prefill():
    # a: 4 decodes running, nothing cached: were the decider to prefill r there, they would wait 1000 tokens
    loads = [EffectiveLoad(decode_requests=4), EffectiveLoad(), EffectiveLoad()]
    cost, scale = DecodeScorer(**CFG, **XFER).costs(_ctx(loads, phase="decode", hint=10), W3)
    # no prefill nodes known: every candidate waits for the remote hand-off (the same 10 ms); a waits
    # for half of its step in progress too (0.016 s)
    assert cost.tolist() == pytest.approx([10 * 0.016 + 4 * 1000 / 1000 + 0.01 + 0.5 * 0.016, 10 * 0.012 + 0.01,
                                           10 * 0.012 + 0.01])
    prefill_phase, _ = DecodeScorer(**CFG, **XFER).costs(_ctx(loads, phase="prefill", hint=10), W3)
    assert prefill_phase.tolist() == pytest.approx([10 * 0.016, 10 * 0.012, 10 * 0.012])  # no prefill harm
    assert scale == pytest.approx(10 * 0.012)  # decode time only: what the request's ITL is made of


def test_decode_phase_prices_the_hand_off_and_queued_local_prefill():
    """A decode on a prefill node reads the state over the host link; queued prefill delays the join."""
    ws = [WorkerState("a", "decode", "n1"), WorkerState("b", "decode", "n0"), WorkerState("c", "decode", "n0")]
    loads = [EffectiveLoad(), EffectiveLoad(), EffectiveLoad(prefill_tokens=50)]
    ctx = _ctx(loads, phase="decode", hint=10)
    ctx.prefill_nodes = frozenset({"n0"})
    cost, _ = DecodeScorer(**CFG, **XFER).costs(ctx, ws)
    own = 10 * 0.012
    assert cost.tolist() == pytest.approx([own + 0.01, own + 0.001, own + 0.001 + 50 / 1000])
    s = DecodeScorer(**CFG, **XFER).score(ctx, ws)
    assert s["b"] == 1.0 and s["a"] == pytest.approx(1 - 0.009 / own) and s["c"] == pytest.approx(1 - 0.05 / own)


def test_decode_phase_prices_the_step_in_progress_on_a_busy_worker():
    """A decode joining a running batch waits for the step in progress: a short output feels it per token."""
    # a: one decode running over no context; b: idle. Both resume r from their node's host tier (not
    # their device: the hand-off moves every row); r has 5 tokens to produce.
    loads = [EffectiveLoad(decode_requests=1), EffectiveLoad(), EffectiveLoad()]
    ctx = _ctx(loads, {"a": PrefixMatch(1000, "host", 250), "b": PrefixMatch(1000, "host", 250),
                       "c": PrefixMatch(1000, "host", 250)}, phase="decode", hint=5)
    step_a, step_b = 0.01 + 0.002 + 1e-6 * 1000, 0.012
    for frac in (0.0, 0.5, 1.0):
        cost, _ = DecodeScorer(**CFG, **XFER, join_step_fraction=frac).costs(ctx, W3)
        assert cost.tolist() == pytest.approx([5 * step_a + 0.01 + frac * step_a, 5 * step_b + 0.01,
                                               5 * step_b + 0.01])
    with pytest.raises(ValueError):
        DecodeScorer(join_step_fraction=1.5)


def test_decode_phase_hand_off_skips_the_rows_on_the_workers_device():
    """A worker resuming r from its own device receives only the rows after them (and the
    checkpoint): a: 800 of 1000 on device, b: 800 in its host tier, c: nothing (remote link)."""
    loads = [EffectiveLoad(), EffectiveLoad(), EffectiveLoad()]
    ctx = _ctx(loads, {"a": PrefixMatch(800, "device", 200), "b": PrefixMatch(800, "host", 200)},
               phase="decode", hint=10)
    cost, _ = DecodeScorer(**CFG, **XFER).costs(ctx, W3)
    own = 10 * 0.012  # idle workers: no prefill harm, no step in progress
    assert cost.tolist() == pytest.approx([own + 0.002, own + 0.01, own + 0.01])  # 200 rows vs 1000


@pytest.mark.parametrize("phase", ["both", "prefill", "decode"])
def test_scores_stay_in_range_and_best_is_one(phase):
    loads = [EffectiveLoad(decode_tokens=1e7, decode_requests=200), EffectiveLoad(decode_requests=1),
             EffectiveLoad(decode_tokens=5e4, decode_requests=3)]
    s = DecodeScorer(**CFG).score(_ctx(loads, phase=phase), W3)
    assert all(0.0 <= v <= 1.0 for v in s.values())
    assert s["b"] == 1.0 and s["a"] == 0.0


def test_registered_and_configurable():
    assert SCORERS["decode"] is DecodeScorer
    prof = build_profile("x", {"scorers": {"decode": {"weight": 2.0, "params": {"prefill_tokens_per_s": 5000}}}})
    scorer, weight = prof.scorers[0]
    assert weight == 2.0 and scorer.config.prefill_tokens_per_s == 5000
    with pytest.raises(ValueError):
        DecodeScorer(prefill_tokens_per_s=0)
    with pytest.raises(ValueError):
        DecodeScorer(remote_gbps=0)


def test_joined_decodes_are_charged_what_r_adds_to_them():
    """count_joined: each of the B_w decodes r joins steps slower while r decodes beside it, by one
    sequence and r's context a step, over r's o steps; an idle worker is charged nothing."""
    loads = [EffectiveLoad(), EffectiveLoad(decode_tokens=2000, decode_requests=2), EffectiveLoad()]
    plain, _ = DecodeScorer(**CFG).costs(_ctx(loads), W3)
    joined, scale = DecodeScorer(**CFG, count_joined=True).costs(_ctx(loads), W3)
    added = 2 * 100 * (0.001 + 1e-6 * 1000)  # B_w * o * (per_seq + per_ctx * prompt)
    assert (joined - plain).tolist() == pytest.approx([0.0, added, 0.0])
    assert scale == pytest.approx(DecodeScorer(**CFG).costs(_ctx(loads), W3)[1])  # r's own time: unchanged


def test_aggregated_default_profile_counts_joined_decodes():
    """Profile "both" (aggregated placement) builds its decode scorer with the joined decodes priced;
    the P/D decode profile keeps the scorer's default (off): its load term weighs the batch."""
    from disagg.router.registry import DEFAULT_PROFILES

    spec = DEFAULT_PROFILES["both"]["scorers"]["decode"]
    assert spec["params"]["count_joined"] is True
    scorer = build_profile("both", DEFAULT_PROFILES["both"]).scorers
    decode = next(s for s, _ in scorer if s.name == "decode")
    assert decode.config.count_joined
    pd = build_profile("decode", DEFAULT_PROFILES["decode"]).scorers
    assert not next(s for s, _ in pd if s.name == "decode").config.count_joined


def test_a_measured_batch_curve_prices_steps_as_the_engine_runs_them():
    """batch_curve: r's step on w is g(B_w + 1) plus its context, and what r adds to each decode it
    joins is g(B_w + 1) - g(B_w), the curve's own slope there; past its ends the curve extrapolates
    linearly, as the simulator's engine does. Where one more sequence costs 10 ms, joining a batch of
    two costs 5.5 times more, over decoding alone, than the 1 ms slope of CFG makes it."""
    from disagg.costs.model import CostModel

    curve = [[1, 0.05], [16, 0.2], [64, 0.6]]
    engine = CostModel(decode_batch_curve=[tuple(p) for p in curve], decode_per_ctx_token_s=1e-6)
    for b in (0, 1, 2, 15, 40, 63, 100):
        loads = [EffectiveLoad(decode_requests=b), EffectiveLoad(), EffectiveLoad()]
        cfg = dict(CFG, batch_curve=curve, count_joined=True, count_queued=False)
        cost, _ = DecodeScorer(**cfg).costs(_ctx(loads), W3)
        step = engine.decode_step_time(b + 1, 1000)  # r's step: b others and r, r's 1000 context tokens
        added = 0.0 if b == 0 else engine.decode_step_time(b + 1, 1000) - engine.decode_step_time(b, 1000)
        harm = b * 1000 / 1000  # r's 1000 uncached tokens stall the b decodes (phase "both")
        assert cost[0] == pytest.approx(100 * step + b * 100 * (added + 1e-6 * 1000) + harm), b
    busy = [EffectiveLoad(decode_requests=2, decode_tokens=2000), EffectiveLoad(), EffectiveLoad()]
    ctx = _ctx(busy, {"a": PrefixMatch(1000, "device", 250)})
    flat, _ = DecodeScorer(**dict(CFG, count_joined=True)).costs(ctx, W3)
    steep, _ = DecodeScorer(**dict(CFG, count_joined=True, batch_curve=[[1, 0.01], [2, 0.02], [64, 0.64]])).costs(ctx, W3)
    # a: r's step at 3 sequences and 3000 context tokens, and 2 decodes it slows; b: r alone
    assert flat.tolist() == pytest.approx([100 * 0.016 + 2 * 100 * 0.002, 100 * 0.012, 100 * 0.012])
    assert steep.tolist() == pytest.approx([100 * 0.033 + 2 * 100 * 0.011, 100 * 0.011, 100 * 0.011])
    for bad in ([], [[0, 0.1]], [[1, 0.1], [1, 0.2]], [[1, -0.1]]):
        with pytest.raises(ValueError):
            DecodeScorer(batch_curve=bad)


def test_decode_phase_charges_a_local_prefill_only_where_the_decider_would_run_one():
    """With the decider's short-suffix rule known (``ctx.local_prefill``: 256 tokens, each running
    decode weighing 1): a (4 decodes, 1000 uncached) would disaggregate, so its batch waits for
    nothing; b (1 decode, 100 uncached: 100 x 2 <= 256) would prefill locally and its decode waits
    0.1 s; ``harm_everywhere`` charges a too."""
    from disagg.router.decider import PDDecider

    loads = [EffectiveLoad(decode_requests=4), EffectiveLoad(decode_requests=1), EffectiveLoad()]
    ctx = _ctx(loads, {"b": PrefixMatch(900, "host", 225)}, phase="decode", hint=10)
    short = PDDecider(local_prefill_max_tokens=256, local_harm_weight=1.0).short_suffix
    ctx.local_prefill = lambda suffix, batch, queued: short(suffix, batch)
    cost, _ = DecodeScorer(**CFG, **XFER).costs(ctx, W3)
    step_a, step_b = 0.01 + 0.005 + 1e-6 * 1000, 0.01 + 0.002 + 1e-6 * 1000
    join_a, join_b = 0.01 + 0.5 * step_a, 0.01 + 0.5 * step_b  # remote hand-off, half a step in progress
    assert cost.tolist() == pytest.approx([10 * step_a + join_a, 10 * step_b + 1 * 100 / 1000 + join_b,
                                           10 * 0.012 + 0.01])
    everywhere, _ = DecodeScorer(**CFG, **XFER, harm_everywhere=True).costs(ctx, W3)
    assert everywhere.tolist() == pytest.approx([cost[0] + 4 * 1000 / 1000, cost[1], cost[2]])
