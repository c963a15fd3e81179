"""The Serve request routers place by the profiles the simulator runs (``router.weights`` unset),
or by ``router.weights`` in every profile when it is set (``deployments.app.request_router_config``)."""

from __future__ import annotations

from deployments.app import request_router_config
from disagg.config import load_config
from disagg.router.registry import DEFAULT_PROFILES
from disagg.router.router import StateAwareRouter


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
