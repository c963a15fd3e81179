"""The Serve request routers place by the profiles the simulator runs (``router.weights`` unset),
or by ``router.weights`` in every profile when it is set (``deployments.app.request_router_config``)."""

from __future__ import annotations

import json

import pytest

from deployments.app import request_router_config
from disagg.config import load_config
from disagg.costs import CostModel, cost_profile
from disagg.router.index import PrefixIndex
from disagg.router.registry import DEFAULT_PROFILES
from disagg.router.router import StateAwareRouter
from disagg.tools.sim.simulator import build_router


def _scorers(policy: dict) -> dict[str, list[str]]:
    router = StateAwareRouter(None, policy)
    return {name: [s[0] for s in prof._plan] for name, prof in router.profiles.items()}


def test_serve_places_by_the_simulators_default_profiles():
    kwargs = request_router_config(load_config({})).request_router_kwargs
    assert "profiles" not in kwargs["policy"]
    got = _scorers(kwargs["policy"])
    assert got == {name: list(p["scorers"]) for name, p in DEFAULT_PROFILES.items()}
    assert "decode" in got["both"] and "decode" in got["decode"] and "wait" in got["prefill"]


def test_router_weights_replace_every_profiles_scorers():
    cfg = load_config({"router": {"weights": {"prefix": 3.0, "load": 1.0}}})
    policy = request_router_config(cfg).request_router_kwargs["policy"]
    assert _scorers(policy) == {"both": ["prefix", "load"], "prefill": ["prefix", "load"], "decode": ["prefix", "load"]}


def _scorer_configs(router: StateAwareRouter) -> dict[tuple[str, str], object]:
    return {(phase, s.name): s.config for phase, prof in router.profiles.items() for s, _ in prof.scorers}


@pytest.mark.parametrize("engine", ["mi355x-k3", "h200-small"])
def test_serve_routers_price_time_as_the_simulators_router_does(engine):
    """``router.engine_profile`` gives the Serve routers the figures the simulator's router takes from
    the engine it simulates (``disagg.router.calibration``): every scorer's config and the pending
    step budget equal, so what wins in the simulator is what serves."""
    policy = request_router_config(load_config({"router": {"engine_profile": engine}})).request_router_kwargs["policy"]
    served = StateAwareRouter(None, policy)
    cost = cost_profile(engine)
    simulated = build_router("state_aware", PrefixIndex(), lambda: 0.0, cost=cost)
    assert _scorer_configs(served) == _scorer_configs(simulated)
    assert served.config.pending_step_tokens == simulated.config.pending_step_tokens == cost.max_prefill_tokens_per_step
    builtin = StateAwareRouter(None, request_router_config(load_config({})).request_router_kwargs["policy"])
    assert _scorer_configs(served) != _scorer_configs(builtin), "the engine's figures are not the built-in ones"
    prefix = next(s for s, _ in served.profiles["prefill"].scorers if s.name == "prefix")
    assert prefix.config.checkpoint_bytes == cost.checkpoint_bytes
    assert policy["area_tau_s"] == request_router_config(load_config({})).request_router_kwargs["policy"]["area_tau_s"]


def test_router_engine_profile_takes_a_file_and_refuses_an_unknown_name(tmp_path):
    """A cost model file (what ``disagg sim calibrate`` writes) is read where the application is built;
    an unknown name fails when the config loads, not when the first request is routed."""
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({**CostModel().to_dict(), "checkpoint_bytes": 1234.0}))
    policy = request_router_config(load_config({"router": {"engine_profile": str(path)}})).request_router_kwargs["policy"]
    assert policy["plugins"]["decode"]["checkpoint_bytes"] == 1234.0
    assert "plugins" not in request_router_config(load_config({})).request_router_kwargs["policy"]
    with pytest.raises(ValueError, match="no profile"):
        load_config({"router": {"engine_profile": "no-such-engine"}})


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_the_decode_deployments_router_is_told_its_prefill_pool(mode, monkeypatch):
    """``deployments.request_router`` NOTE 2: in P/D the decode deployment's router reads its prefill
    deployment's view before it places; the prefill deployment's router, and an aggregated app's,
    are told none."""
    import deployments.app as app
    from deployments.servers import PREFILL_DEPLOYMENT

    cfg = load_config({"deployment": {"mode": mode}})
    told = {}
    real = app.deployment_options

    def recorded(rc, cfg, routed=True, prefill_pool=None):
        opts = real(rc, cfg, routed, prefill_pool)
        if routed:
            role = "prefill" if rc is cfg.deployment.prefill else "decode"
            told[role] = opts["request_router_config"].request_router_kwargs.get("prefill_pool")
        return opts

    monkeypatch.setattr(app, "deployment_options", recorded)
    app.build_app(cfg)
    assert told == ({"decode": PREFILL_DEPLOYMENT, "prefill": None} if mode == "disaggregated" else {"decode": None})
