"""``disagg.launch.local.free_port``: ports for listeners that bind later (HAProxy's stats and
metrics, test HTTP fronts) come from below the kernel's ephemeral range, where no process that
binds port 0 or connects out can be handed the same port in between."""

from __future__ import annotations

import socket

from disagg.launch import local


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    lo, _ = local._ephemeral_range()
    ports = [local.free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(local._LOW_PORT <= p < lo for p in ports)
    for p in ports[:5]:  # free on every interface
        with socket.socket() as s:
            s.bind(("", p))


def test_a_port_in_use_or_handed_out_before_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        given = local.free_port()
        picks = iter([busy, given, busy, given])  # both taken: the loop keeps drawing
        after = iter(range(local._LOW_PORT + 1, local._LOW_PORT + 200))  # then ports of its range

        class Draws:
            def randrange(self, a, b):
                return next(picks, None) or next(after)

        monkeypatch.setattr(local.random, "SystemRandom", Draws)
        monkeypatch.setattr(local, "_ephemeral_range", lambda: (65000, 65535))  # busy is below it
        got = local.free_port()
        assert got not in (busy, given) and local._LOW_PORT < got < local._LOW_PORT + 200


def test_a_parents_exported_cluster_env_is_renewed_a_users_wins(monkeypatch):
    """A process started by one that ran a local cluster inherits that cluster's settings (its
    HAProxy ports, its shim's path, removed at its shutdown): recorded in
    ``DISAGG_CLUSTER_ENV_EXPORTED`` with the values exported, they are renewed; a variable the user
    set, or changed since it was recorded, wins."""
    import json
    import os

    monkeypatch.setattr(local, "_exported", set())  # a fresh process: nothing exported here yet
    monkeypatch.setattr(local, "_haproxy_available", lambda: False)  # no shim written for this test
    saved = dict(os.environ)
    try:
        os.environ["RAY_worker_niceness"] = "7"  # the parent's launcher exported this one
        os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "99"  # the user set this one
        os.environ["RAY_SERVE_LOG_TO_STDERR"] = "1"  # ... and changed this one after it was recorded
        os.environ[local._EXPORTED_ENV] = json.dumps({"RAY_worker_niceness": "7",
                                                      "RAY_SERVE_LOG_TO_STDERR": "0"})
        local.export_cluster_env()
        assert os.environ["RAY_worker_niceness"] == local.CLUSTER_ENV["RAY_worker_niceness"]
        assert os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "99"
        assert os.environ["RAY_SERVE_LOG_TO_STDERR"] == "1"
        recorded = json.loads(os.environ[local._EXPORTED_ENV])
        assert recorded["RAY_worker_niceness"] == local.CLUSTER_ENV["RAY_worker_niceness"]
        assert "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S" not in recorded
        os.environ[local._EXPORTED_ENV] = "not json"  # a damaged record: the caller's values win
        os.environ["RAY_worker_niceness"] = "3"
        monkeypatch.setattr(local, "_exported", set())
        local.export_cluster_env()
        assert os.environ["RAY_worker_niceness"] == "3"
    finally:  # export_cluster_env wrote os.environ directly
        os.environ.clear()
        os.environ.update(saved)
