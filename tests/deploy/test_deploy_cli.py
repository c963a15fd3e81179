"""`disagg deploy`: building, checking and sending a `serve deploy` config."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import ray
import yaml

from disagg.config import load_config
from disagg.launch.cli import main
from disagg.launch.deploy import apply_sets, build_serve_config, parse_set, run_deploy

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIGS = sorted((ROOT / "deployments" / "configs").glob("*.yaml")) + sorted(
    (ROOT / "deployments" / "cluster" / "serve").glob("*.yaml"))


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_shipped_serve_config_builds_to_the_same_app(path):
    config = build_serve_config(path)
    assert load_config(config) == load_config(path)
    source = yaml.safe_load(path.read_text())
    assert config["proxy_location"] == source["proxy_location"]
    assert config["applications"][0]["name"] == source["applications"][0]["name"]


def test_a_bare_app_config_is_wrapped(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text("model: {name: tiny}\nhttp: {host: 0.0.0.0, port: 9000}\n")
    config = build_serve_config(path)
    assert config["applications"][0] == {"name": "disagg", "route_prefix": "/", "import_path": "deployments.app:build_app",
                                         "args": {"model": {"name": "tiny"}, "http": {"host": "0.0.0.0", "port": 9000}}}
    assert config["http_options"] == {"host": "0.0.0.0", "port": 9000}


def test_sets_override_and_are_validated():
    path = ROOT / "deployments" / "configs" / "local-cpu.yaml"
    config = build_serve_config(path, ["deployment.decode.max_replicas=4", "deployment.decode.min_replicas=1",
                                       "deployment.decode.resources={disagg_decode: 1}", "model.seed=7"])
    cfg = load_config(config)
    assert (cfg.deployment.decode.min_replicas, cfg.deployment.decode.max_replicas) == (1, 4)
    assert cfg.deployment.decode.resources == {"disagg_decode": 1.0} and cfg.model.seed == 7
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 64"):
        build_serve_config(path, ["engine.block_size=100"])
    with pytest.raises(ValueError, match="min_replicas and max_replicas"):
        build_serve_config(path, ["deployment.decode.min_replicas=1"])


@pytest.mark.parametrize("item, error", [("model.name", "KEY.PATH=VALUE"), ("model..name=x", "KEY.PATH=VALUE"),
                                         ("=x", "KEY.PATH=VALUE")])
def test_malformed_sets(item, error):
    with pytest.raises(ValueError, match=error):
        parse_set(item)


def test_set_through_a_scalar_is_refused():
    with pytest.raises(ValueError, match="'name' is not a mapping"):
        apply_sets({"model": {"name": "tiny"}}, ["model.name.x=1"])


def test_foreign_or_multi_app_configs_are_refused(tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"applications": [{"name": "x", "import_path": "mymod:app", "args": {}}]}))
    with pytest.raises(ValueError, match="import_path must be"):
        build_serve_config(other)
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({"applications": [{"name": "a", "args": {}}, {"name": "b", "args": {}}]}))
    with pytest.raises(ValueError, match="exactly one application"):
        build_serve_config(two)


def test_cli_dry_run_prints_a_loadable_config(capsys, tmp_path):
    out = tmp_path / "serve.yaml"
    rc = main(["deploy", "--config", str(ROOT / "deployments/configs/mi355x-node.yaml"), "--dry-run",
               "--set", "router.local_prefill_max_tokens=4096"])
    assert rc == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert load_config(printed).router.local_prefill_max_tokens == 4096
    assert main(["deploy", "--config", str(ROOT / "deployments/configs/mi355x-node.yaml"), "--dry-run",
                 "--output", str(out)]) == 0
    assert load_config(out) == load_config(ROOT / "deployments/configs/mi355x-node.yaml")


def test_cli_reports_bad_input(capsys, tmp_path):
    assert main(["deploy", "--config", str(tmp_path / "missing.yaml"), "--dry-run"]) == 2
    assert "disagg deploy:" in capsys.readouterr().err


class _FakeDashboard(BaseHTTPRequestHandler):
    """The two routes of the Ray dashboard's REST API that `serve deploy` calls."""

    received: list[dict] = []
    status = 200

    def do_GET(self):  # noqa: N802
        if self.path == "/api/ray/version":
            self._reply(200, {"version": "5", "ray_version": ray.__version__, "ray_commit": "test"})
        else:
            self._reply(404, {})

    def do_PUT(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/api/serve/applications/":
            type(self).received.append(json.loads(body))
            self._reply(type(self).status, {} if type(self).status == 200 else {"error": "bad config"})
        else:
            self._reply(404, {})

    def _reply(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def dashboard():
    """A stand-in for the Ray dashboard on loopback: the boundary `serve deploy` talks to
    (starting a real Ray cluster here would only test Ray)."""
    _FakeDashboard.received, _FakeDashboard.status = [], 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeDashboard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_deploy_sends_the_config_to_the_dashboard(dashboard, capsys):
    path = ROOT / "deployments" / "cluster" / "serve" / "mi355x-cluster.yaml"
    assert run_deploy(str(path), ["deployment.decode.max_replicas=16"], dashboard) == 0
    (sent,) = _FakeDashboard.received
    assert sent == build_serve_config(path, ["deployment.decode.max_replicas=16"])
    assert load_config(sent).deployment.decode.max_replicas == 16
    assert "serve status --address" in capsys.readouterr().out


def test_deploy_reports_a_refusal(dashboard, capsys):
    _FakeDashboard.status = 400
    path = ROOT / "deployments" / "configs" / "local-cpu.yaml"
    assert main(["deploy", "--config", str(path), "--address", dashboard]) == 1
    assert "400" in capsys.readouterr().err


def test_deploy_reports_an_unreachable_dashboard(capsys):
    path = ROOT / "deployments" / "configs" / "local-cpu.yaml"
    assert run_deploy(str(path), [], "http://127.0.0.1:9") == 1  # discard port: nothing listens
    assert "Failed to connect" in capsys.readouterr().err
