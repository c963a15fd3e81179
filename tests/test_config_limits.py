"""Limits that agree (``disagg.config.AppConfig`` NOTE 1): the ingress takes every request its
admission gate may run or queue, so overload is shed by the gate (503 + Retry-After) instead of
waiting in Serve's queue out of sight."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.config import INGRESS_HEADROOM, load_config

CONFIGS = sorted((Path(__file__).parents[1] / "deployments" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_lets_the_gate_see_all_overload(path):
    cfg = load_config(path)
    http = cfg.http
    assert cfg.deployment.ingress.max_ongoing_requests >= http.max_inflight + http.max_queued + INGRESS_HEADROOM


def test_an_ingress_section_without_a_limit_gets_the_derived_one():
    """local-cpu.yaml's ``ingress: {num_replicas: 1, num_cpus: 0.5}`` used to drop the limit to 64."""
    cfg = load_config({"deployment": {"ingress": {"num_replicas": 1, "num_cpus": 0.5}},
                       "http": {"max_inflight": 100, "max_queued": 50}})
    assert cfg.deployment.ingress.max_ongoing_requests == 100 + 50 + INGRESS_HEADROOM
    assert load_config({}).deployment.ingress.max_ongoing_requests == 256 + 512 + INGRESS_HEADROOM


def test_a_limit_below_the_gate_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"max_ongoing_requests 64 is below .* = 832"):
        load_config({"deployment": {"ingress": {"max_ongoing_requests": 64}}})


def test_a_limit_at_or_above_the_gate_is_kept():
    cfg = load_config({"deployment": {"ingress": {"max_ongoing_requests": 5000}}})
    assert cfg.deployment.ingress.max_ongoing_requests == 5000


def test_the_derived_limit_survives_the_round_trip_to_the_replicas():
    """``build_app`` hands the replicas ``model_dump()``; they load it again."""
    cfg = load_config({"http": {"max_inflight": 8, "max_queued": 8}})
    again = load_config(cfg.model_dump())
    assert again.deployment.ingress.max_ongoing_requests == cfg.deployment.ingress.max_ongoing_requests == 80


def test_prefill_and_decode_limits_are_their_own():
    cfg = load_config({"http": {"max_inflight": 1000}})
    assert cfg.deployment.decode.max_ongoing_requests == 64 and cfg.deployment.prefill.max_ongoing_requests == 64
