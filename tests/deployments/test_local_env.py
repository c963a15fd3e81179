"""The local cluster's process settings (``disagg.local.export_cluster_env``): no Ray started."""

from __future__ import annotations

import os
import shlex
import sys

import pytest

from disagg import local

KEYS = {*local.SERVE_ENV, *local.CLUSTER_ENV, *local.HAPROXY_ENV, *local._HAPROXY_PORT_KEYS,
        "RAY_SERVE_HAPROXY_BINARY_PATH"}


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
