"""`ray up` cluster configs (deployments/cluster/*.yaml) against Ray's own checks: the
cluster-config schema shipped in the ray wheel (ray/autoscaler/ray-schema.json, through
the same prepare_config + validate_config that `ray up` runs) and the `ray start`
command-line parser, plus the sizes the Serve config they pair with needs."""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.scripts.scripts import start as ray_start

from disagg.config import AppConfig
from disagg.launch.deploy import build_serve_config
from disagg.launch.local import NODE_ENV, SERVE_ENV

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_DIR = ROOT / "deployments" / "cluster"
CLUSTER_YAMLS = sorted(CLUSTER_DIR.glob("*.yaml"))
GIB = 1 << 30


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _statements(command: str) -> list[list[str]]:
    """Shell words of each statement of ``command`` (split at ; && ||)."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    out, cur = [], []
    for tok in lex:
        if tok in (";", "&&", "||"):
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [s for s in out + [cur] if s]


def _ray_starts(commands: list[str]) -> list[tuple[dict, dict]]:
    """(env exported before it, parsed click params) of every `ray start` in ``commands``."""
    found = []
    for command in commands:
        env: dict[str, str] = {}
        for words in _statements(command):
            if words[0] == "export":
                env.update(w.split("=", 1) for w in words[1:])
            elif words[:2] == ["ray", "start"]:
                ctx = ray_start.make_context("ray start", words[2:])  # raises on an unknown or malformed flag
                found.append((env, ctx.params))
    return found


def _size_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)", text.lower())
    assert m, text
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]


def _run_option(options: list[str], flag: str) -> list[str]:
    return [o.split("=", 1)[1] for o in options if o.startswith(flag + "=")]


def _app(cluster: dict) -> AppConfig:
    serve = build_serve_config(ROOT / cluster["metadata"]["disagg"]["serve_config"])
    return AppConfig.model_validate(serve["applications"][0]["args"])


def test_there_is_an_on_prem_and_a_cloud_config():
    types = {_load(p)["provider"]["type"] for p in CLUSTER_YAMLS}
    assert {"local", "aws"} <= types


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_validates_against_rays_cluster_schema(path):
    config = prepare_config(_load(path))  # what `ray up` does before launching anything
    validate_config(config)  # jsonschema against ray/autoscaler/ray-schema.json + Ray's own checks


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_schema_check_catches_a_typo(path):
    config = _load(path)
    config["docker"]["run_option"] = config["docker"].pop("run_options")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_start_commands_parse_and_export_the_serve_env(path):
    cluster = _load(path)
    heads = _ray_starts(cluster["head_start_ray_commands"])
    workers = _ray_starts(cluster["worker_start_ray_commands"])
    assert len(heads) == 1 and heads[0][1]["head"] is True
    assert len(workers) == 1 and workers[0][1]["address"] == "$RAY_HEAD_IP:6379"
    mount = next(remote for remote, local in cluster["file_mounts"].items() if local == ".")
    for env, params in heads + workers:
        shim = env.pop("RAY_SERVE_HAPROXY_BINARY_PATH")
        assert env == {**SERVE_ENV, **NODE_ENV}  # the same settings `disagg serve` uses
        assert shim == f"{mount}/deployments/cluster/haproxy-front"  # HAProxy's stats page on loopback
        assert (ROOT / "deployments" / "cluster" / "haproxy-front").is_file()
        assert params["metrics_export_port"] == 8080
        if params["resources"]:
            json.loads(params["resources"])


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_gpu_nodes_advertise_gpus_and_the_replicas_accelerator(path):
    cluster = _load(path)
    app = _app(cluster)
    gpus_per_node = cluster["metadata"]["disagg"]["gpus_per_node"]
    wanted = {rc.accelerator_type for rc in (app.deployment.prefill, app.deployment.decode) if rc.num_gpus}
    assert len(wanted) == 1
    accel = f"accelerator_type:{wanted.pop()}"
    if cluster["provider"]["type"] == "local":  # one node type: GPUs and accelerator in `ray start`
        for _, params in _ray_starts(cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]):
            assert params["num_gpus"] == gpus_per_node
            assert json.loads(params["resources"])[accel] == 1
    else:  # node types declare their resources for the autoscaler
        gpu_types = [t for t in cluster["available_node_types"].values() if t["resources"].get("GPU")]
        assert gpu_types
        for node_type in gpu_types:
            assert node_type["resources"]["GPU"] == gpus_per_node and node_type["resources"][accel] == 1


def _gpu_nodes(cluster: dict) -> int:
    if cluster["provider"]["type"] == "local":
        return 1 + len(cluster["provider"]["worker_ips"])
    return sum(t.get("max_workers", 0) for t in cluster["available_node_types"].values() if t["resources"].get("GPU"))


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_holds_the_serve_replicas_at_their_bounds(path):
    cluster = _load(path)
    app = _app(cluster)
    need = 0.0
    for rc in (app.deployment.prefill, app.deployment.decode):
        n = rc.max_replicas if rc.min_replicas is not None else rc.num_replicas
        need += n * (rc.num_gpus + (rc.tensor_parallel_size - 1 if rc.num_gpus else 0))
    have = _gpu_nodes(cluster) * cluster["metadata"]["disagg"]["gpus_per_node"]
    assert 0 < need <= have


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_dev_shm_holds_object_store_and_host_tier(path):
    """/dev/shm of a GPU node holds Ray's object store and the node's host tier (both live
    there), with room left for collective-communication buffers; pinning needs memlock."""
    cluster = _load(path)
    docker = cluster["docker"]
    options = docker["run_options"] + docker.get("worker_run_options", [])
    shm = _run_option(options, "--shm-size")
    assert len(shm) == 1
    (_, params), = _ray_starts(cluster["worker_start_ray_commands"])
    host = _app(cluster).transfer.host
    spare = _size_bytes(shm[0]) - params["object_store_memory"] - (host.capacity_mb << 20)
    assert spare >= 4 * GIB, f"/dev/shm leaves {spare / GIB:.1f} GiB"
    if host.pin_memory:
        assert "memlock=-1:-1" in _run_option(options, "--ulimit")


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_paths_the_app_reads_are_mounted_into_the_container(path):
    cluster = _load(path)
    app = _app(cluster)
    mounted = [v.split(":")[1] for v in _run_option(cluster["docker"]["run_options"], "--volume")]
    wanted = []
    if app.transfer.disk.enabled:
        wanted.append(app.transfer.disk.path)
    if app.http.api_keys_file:
        wanted.append(os.path.dirname(app.http.api_keys_file))
    for p in wanted:
        assert any(p == m or p.startswith(m.rstrip("/") + "/") for m in mounted), p


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_setup_installs_this_package_and_the_local_ray(path):
    cluster = _load(path)
    repo_mount = next(dst for dst, src in cluster["file_mounts"].items() if src == ".")
    words = [w for c in cluster["setup_commands"] for s in _statements(c) for w in s]
    assert f"ray[default,serve]=={ray.__version__}" in words  # `ray up` needs the same Ray on both ends
    assert any(w == repo_mount or w.startswith(repo_mount + "[") for w in words)


def test_package_data_ships_the_cluster_configs():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["deployments"]
    files = [p.relative_to(ROOT / "deployments").as_posix() for p in CLUSTER_DIR.rglob("*.yaml")]
    assert files and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), files


def test_prepare_config_fills_the_single_local_node_type():
    """The on-prem file names no node types: Ray derives one from head_ip and worker_ips."""
    local = next(_load(p) for p in CLUSTER_YAMLS if _load(p)["provider"]["type"] == "local")
    prepared = prepare_config(copy.deepcopy(local))
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(local["provider"]["worker_ips"])
