"""The router's time constants from an engine's cost model (disagg.router.calibration)."""

from __future__ import annotations

import dataclasses

import pytest

from disagg.costs.model import CostModel
from disagg.costs.profile import cost_profile
from disagg.router.calibration import engine_router_config, with_engine_costs
from disagg.router.router import RouterConfig, StateAwareRouter


def _scorer_configs(router: StateAwareRouter) -> dict:
    return {(p, s.name): dataclasses.asdict(s.config) if hasattr(s, "config") else None
            for p, prof in router.profiles.items() for s, _ in prof.scorers}


def test_the_builtin_engine_maps_to_the_builtin_constants():
    """The scorers' built-in constants are the small cost model's: calibrated to it, every scorer of
    every profile is configured exactly as without calibration, so a run on it places as before."""
    cfg = with_engine_costs(None, CostModel().to_dict())
    assert _scorer_configs(StateAwareRouter(None, cfg)) == _scorer_configs(StateAwareRouter())
    assert RouterConfig.from_dict(cfg).pending_step_tokens == RouterConfig().pending_step_tokens


def test_an_engine_of_another_speed_gets_its_own_figures():
    """A measured H200 profile: its prefill rate, its decode curve in the decode scorer; the MI355X
    roofline: 13.8 KB a token, 150 MB checkpoints. The wait scorer keeps its own figures (a ratio in
    which the rate cancels; see disagg.router.calibration)."""
    h200 = cost_profile("h200-small")
    cfg = engine_router_config(h200.to_dict())
    rate = round(1 / h200.prefill_per_token_s)
    assert cfg["plugins"]["decode"]["prefill_tokens_per_s"] == pytest.approx(rate, rel=1e-5)
    assert "wait" not in cfg["plugins"]
    assert cfg["plugins"]["prefix"]["prefill_tokens_per_s"] == pytest.approx(0.8 * rate, rel=1e-5)
    assert cfg["plugins"]["decode"]["batch_curve"] == [[b, g] for b, g in h200.decode_batch_curve]
    router = StateAwareRouter(None, cfg)
    decode = next(s for s, _ in router.profiles["both"].scorers if s.name == "decode")
    assert decode.config.batch_curve and decode.config.count_joined  # the profile's own params kept
    mi = engine_router_config(cost_profile("mi355x-k3").to_dict())
    assert mi["plugins"]["prefix"]["bytes_per_token"] == 13824.0
    assert mi["plugins"]["decode"]["checkpoint_bytes"] == pytest.approx(149790720.0)
    assert mi["pending_step_tokens"] == 16384
    with pytest.raises(ValueError):
        engine_router_config({**CostModel().to_dict(), "prefill_per_token_s": 0.0})


def test_what_the_caller_sets_wins_and_nothing_is_modified():
    mine = {"plugins": {"decode": {"prefill_tokens_per_s": 1000.0}, "affinity": {}}, "pending_step_tokens": 4096}
    before = repr(mine)
    cfg = with_engine_costs(mine, cost_profile("mi355x-k3").to_dict())
    assert repr(mine) == before
    assert cfg["plugins"]["decode"]["prefill_tokens_per_s"] == 1000.0
    assert cfg["plugins"]["decode"]["checkpoint_bytes"] > 1e8  # the engine's, where the caller is silent
    assert cfg["pending_step_tokens"] == 4096
    assert cfg["plugins"]["affinity"] == {}
    StateAwareRouter(None, cfg)  # every key is one the router takes


def test_the_simulator_prices_with_the_engine_it_simulates():
    """``Simulator`` / ``build_router``: the state-aware router takes the simulated engine's figures
    (what the run's router config sets wins); "builtin" keeps the scorers' constants; the baselines
    take no config at all."""
    from disagg.router.index import PrefixIndex
    from disagg.tools.sim.simulator import build_router

    h200 = cost_profile("h200-small")

    def decode_cfg(**kw):
        router = build_router("state_aware", PrefixIndex(), lambda: 0.0, cost=h200, **kw)
        return next(s for s, _ in router.profiles["decode"].scorers if s.name == "decode").config

    assert decode_cfg().batch_curve == [[b, g] for b, g in h200.decode_batch_curve]
    assert decode_cfg(router_costs="builtin").batch_curve is None
    mine = decode_cfg(router_config={"plugins": {"decode": {"batch_curve": [[1, 0.5]]}}})
    assert mine.batch_curve == [[1, 0.5]] and mine.prefill_tokens_per_s == pytest.approx(1 / h200.prefill_per_token_s)
    with pytest.raises(ValueError, match="router_costs"):
        decode_cfg(router_costs="nope")
    assert build_router("round_robin", PrefixIndex(), lambda: 0.0, cost=h200).name == "round_robin"
