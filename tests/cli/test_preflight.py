"""``disagg.launch.preflight``'s checks in-process (the CLI's subprocess tests cover the wiring)."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from disagg.config import AppConfig, load_config
from disagg.launch.preflight import (
    UsageError,
    check_cpus,
    check_model,
    check_port,
    explain_validation,
)


def _lines(data: dict) -> list[str]:
    with pytest.raises(ValidationError) as info:
        load_config(data)
    return explain_validation(info.value, "app.yaml")


@pytest.mark.parametrize(("data", "want"), [
    ({"modle": {}}, "app.yaml: unknown key 'modle'; did you mean 'model'?"),
    ({"transfer": {"host": {"capacity": 1}}}, "app.yaml: unknown key 'transfer.host.capacity'; "
                                              "did you mean 'transfer.host.capacity_mb'?"),
    ({"faults": {"rules": [{"fault": "drop", "rate": 0.5, "nht": 1}]}},
     "app.yaml: unknown key 'faults.rules.0.nht'; did you mean 'faults.rules.0.nth'?"),
    ({"http": {"zzz": 1}}, "app.yaml: unknown key 'http.zzz'; known keys here: host, port, api_keys, "),
    ({"http": {"port": "eighty"}}, "app.yaml: http.port: Input should be a valid integer, unable to parse "
                                   "string as an integer (got 'eighty')"),
])
def test_one_line_per_bad_key(data, want):
    lines = _lines(data)
    assert len(lines) == 1 and lines[0].startswith(want), lines


@pytest.mark.parametrize(("deployment", "cpus", "ok"), [
    ({}, 4, True),  # defaults: ingress 0.5 + decode 1 + prefill 1
    ({}, 2, False),
    ({"mode": "aggregated"}, 2, True),  # no prefill replica
    ({"decode": {"min_replicas": 2, "max_replicas": 8}}, 4, True),  # autoscaling starts at min_replicas
    ({"decode": {"min_replicas": 3, "max_replicas": 8}}, 4, False),
])
def test_cpu_reservations_against_the_cluster(deployment, cpus, ok):
    cfg = AppConfig.model_validate({"deployment": deployment})
    if ok:
        check_cpus(cfg, cpus)
    else:
        with pytest.raises(UsageError, match="the replicas reserve"):
            check_cpus(cfg, cpus)


def test_a_checkpoint_directory_needs_a_config_json(tmp_path):
    cfg = AppConfig.model_validate({"model": {"name": str(tmp_path)}})
    with pytest.raises(UsageError, match="has no config.json"):
        check_model(cfg)
    (tmp_path / "config.json").write_text("{}")
    check_model(cfg)  # a directory with a config.json passes (its contents are the engine's to check)


def test_vllm_model_names_are_left_to_vllm():
    check_model(AppConfig.model_validate({"model": {"name": "moonshotai/Kimi-K3"}, "engine": {"backend": "vllm"}}))


def test_a_listening_port_is_in_use_and_a_closed_one_is_not():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        with pytest.raises(UsageError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port("127.0.0.1", port)
    check_port("127.0.0.1", port)
