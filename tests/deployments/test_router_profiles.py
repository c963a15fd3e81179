"""The Serve request routers place by the profiles the simulator runs (``router.weights`` unset),
or by ``router.weights`` in every profile when it is set (``deployments.app.request_router_config``)."""

from __future__ import annotations

import pytest

from deployments.app import request_router_config
from disagg.config import load_config
from disagg.router.registry import DEFAULT_PROFILES
from disagg.router.router import StateAwareRouter
from disagg.tools.sim.profile import cost_profile


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


def test_router_engine_profile_prices_time_as_the_replicas_engine_runs():
    """``router.engine_profile`` gives the Serve routers the engine's figures, as the simulator's
    router gets them from its cost model (disagg.router.calibration); an unknown name fails when
    the config loads, not when the first request is routed."""
    policy = request_router_config(load_config({"router": {"engine_profile": "mi355x-k3"}})).request_router_kwargs["policy"]
    router = StateAwareRouter(None, policy)
    prefix = next(s for s, _ in router.profiles["prefill"].scorers if s.name == "prefix")
    assert prefix.config.checkpoint_bytes == cost_profile("mi355x-k3").checkpoint_bytes
    assert policy["area_tau_s"] == request_router_config(load_config({})).request_router_kwargs["policy"]["area_tau_s"]
    assert "plugins" not in request_router_config(load_config({})).request_router_kwargs["policy"]
    with pytest.raises(ValueError, match="no profile"):
        load_config({"router": {"engine_profile": "no-such-engine"}})
