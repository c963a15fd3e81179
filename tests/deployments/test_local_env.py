"""The local cluster's process settings (``disagg.launch.local.export_cluster_env``): no Ray started."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys

import pytest

from disagg.config import HTTPConfig, load_config
from disagg.launch import local

KEYS = {*local.SERVE_ENV, *local.CLUSTER_ENV, *local.HAPROXY_ENV, *local._HAPROXY_PORT_KEYS,
        "RAY_SERVE_HAPROXY_BINARY_PATH", *local.front_env(HTTPConfig()), local._EXPORTED_ENV}


@pytest.fixture
def environ(monkeypatch):
    """A copy of the process environment without any of the keys under test."""
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setattr(local, "_exported", set())
    return env


def test_replicas_run_at_the_drivers_priority_with_the_serve_settings(environ, monkeypatch):
    monkeypatch.setattr(local, "_haproxy_available", lambda: True)
    local.export_cluster_env()
    assert environ["RAY_worker_niceness"] == "0"
    assert {k: environ[k] for k in local.SERVE_ENV} == local.SERVE_ENV
    assert environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    stats, metrics = (int(environ[k]) for k in local._HAPROXY_PORT_KEYS)
    assert 0 < stats < 65536 and 0 < metrics < 65536 and stats != metrics


def test_haproxy_starts_through_the_loopback_stats_shim(environ, monkeypatch):
    from deployments.haproxy_front import SHIM

    monkeypatch.setattr(local, "_haproxy_available", lambda: True)
    local.export_cluster_env()
    shim = environ["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert os.access(shim, os.X_OK)
    assert open(shim).read() == SHIM.format(python=shlex.quote(sys.executable))  # this interpreter runs the rewrite


def test_the_callers_haproxy_binary_wins(environ, monkeypatch):
    monkeypatch.setattr(local, "_haproxy_available", lambda: True)
    environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = "/opt/haproxy/bin/haproxy"
    local.export_cluster_env()
    assert environ["RAY_SERVE_HAPROXY_BINARY_PATH"] == "/opt/haproxy/bin/haproxy"


def test_the_callers_own_setting_wins(environ, monkeypatch):
    monkeypatch.setattr(local, "_haproxy_available", lambda: True)
    environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    environ["RAY_worker_niceness"] = "15"
    local.export_cluster_env()
    local.export_cluster_env()
    assert environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert environ["RAY_worker_niceness"] == "15"


def test_ports_set_here_are_renewed_for_the_next_cluster(environ, monkeypatch):
    monkeypatch.setattr(local, "_haproxy_available", lambda: True)
    local.export_cluster_env()
    key = local._HAPROXY_PORT_KEYS[0]
    environ[key] = "stale"  # what a previous cluster of this process left
    local.export_cluster_env()
    assert environ[key].isdigit()


def test_no_haproxy_binary_keeps_serves_own_proxy(environ, monkeypatch):
    monkeypatch.setattr(local, "_haproxy_available", lambda: False)
    local.export_cluster_env()
    assert environ["RAY_worker_niceness"] == "0"
    assert not any(k in environ for k in (*local.HAPROXY_ENV, *local._HAPROXY_PORT_KEYS))


def test_the_node_env_of_deployed_clusters_is_what_the_local_cluster_sets():
    local_cluster = {**local.CLUSTER_ENV, **local.HAPROXY_ENV}
    assert {k: local_cluster[k] for k in local.NODE_ENV} == local.NODE_ENV


def test_the_fronts_limits_follow_the_config(environ, monkeypatch):
    monkeypatch.setattr(local, "_haproxy_available", lambda: True)
    local.export_cluster_env(HTTPConfig(header_timeout_s=3, body_timeout_s=9, keep_alive_timeout_s=2,
                                        max_connections_per_client=11))
    assert {k: environ[k] for k in local.front_env(HTTPConfig())} == {
        "DISAGG_FRONT_HEADER_TIMEOUT_S": "3", "DISAGG_FRONT_BODY_TIMEOUT_S": "9",
        "DISAGG_FRONT_KEEP_ALIVE_TIMEOUT_S": "2", "DISAGG_FRONT_MAX_CONNECTIONS_PER_CLIENT": "11"}


# -- placement: ``disagg serve`` fails fast when the cluster cannot place the replicas -------------
def _cfg(**deployment):
    return load_config({"deployment": {"ingress": {"num_cpus": 0.5}, "prefill": {"num_cpus": 1},
                                       "decode": {"num_cpus": 1}, **deployment}})


def test_requested_resources_add_up_every_role():
    assert local.requested_resources(_cfg()) == {"CPU": 2.5}
    agg = _cfg(mode="aggregated")
    assert local.requested_resources(agg) == {"CPU": 1.5}  # no prefill replicas
    tp = _cfg(decode={"num_cpus": 2, "num_gpus": 1, "tensor_parallel_size": 4, "num_replicas": 2})
    assert local.requested_resources(tp) == {"CPU": 0.5 + 1 + 2 * (2 + 3), "GPU": 2 * 4}
    auto = _cfg(prefill={"num_cpus": 1, "min_replicas": 3, "max_replicas": 9, "resources": {"role_p": 1}})
    assert local.requested_resources(auto) == {"CPU": 0.5 + 3 + 1, "role_p": 3}


def test_a_cluster_too_small_is_refused_naming_each_short_resource():
    cfg = _cfg(decode={"num_cpus": 8, "num_gpus": 1})
    with pytest.raises(local.PlacementError) as err:
        local.check_placement(cfg, {"CPU": 4.0, "memory": 1e9})
    assert "CPU: replicas ask for 9.5, the cluster has 4" in str(err.value)
    assert "GPU: replicas ask for 1, the cluster has 0" in str(err.value)
    local.check_placement(cfg, {"CPU": 9.5, "GPU": 1.0})  # exactly enough: placed


def test_serve_exits_2_with_the_message_instead_of_waiting(monkeypatch, capsys):
    """``disagg serve`` against a cluster that cannot place the replicas: one ``error:`` line
    naming the short resource, exit status 2, no wait and no traceback."""
    from disagg.launch import cli

    @contextlib.contextmanager
    def refuse(cfg, name=local.APP_NAME):
        raise local.PlacementError("the cluster cannot place the configured replicas (CPU: ...)")
        yield

    monkeypatch.setattr(local, "local_app", refuse)
    monkeypatch.setattr(local, "_trap_stop_signals", lambda: None)  # keep pytest's own handlers
    assert cli.main(["serve", "--port", str(local.free_port())]) == 2
    err = capsys.readouterr().err
    assert "error: the cluster cannot place the configured replicas" in err and "Traceback" not in err
