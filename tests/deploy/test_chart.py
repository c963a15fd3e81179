"""The Helm chart, rendered and linted by Helm's own engine (helm-python-sdk bundles
Helm's Go library: no helm binary, no cluster, no network)."""

from __future__ import annotations

import json
import math

import pytest
from helm_python import HelmError, HelmValuesError, chart

from disagg.config import AppConfig, load_config
from disagg.launch.deploy import synced_values_schema, validate_serve_config
from disagg.launch.local import NODE_ENV, SERVE_ENV
from tests.deploy.chart import (
    CHART,
    EXAMPLES,
    example_values,
    gi,
    merge,
    one,
    pod_templates,
    ray_resources_param,
    render,
    render_objects,
    serve_config,
    worker_groups,
)

GIB = 1 << 30


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {ex: render_objects(example_values(ex)) for ex in EXAMPLES}


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_lints_clean(example):
    report = chart.lint(CHART, values=example_values(example), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # info ("icon is recommended") only
    assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("example, kinds", [
    ("defaults", ["ConfigMap", "NetworkPolicy", "RayService"]),
    ("cpu-smoke", ["ConfigMap", "NetworkPolicy", "RayService", "Secret"]),
    ("mi355x", ["ConfigMap", "ConfigMap", "Ingress", "NetworkPolicy", "RayService", "ServiceMonitor"]),
    ("mi355x-dedicated", ["ConfigMap", "ConfigMap", "Ingress", "NetworkPolicy", "RayService", "ServiceMonitor"]),
])
def test_renders_expected_objects(rendered, example, kinds):
    assert sorted(o["kind"] for o in rendered[example]) == kinds


def test_values_schema_embeds_the_current_app_config():
    """values.schema.json's $defs are AppConfig's schema: `helm install` rejects what load_config would."""
    path = CHART / "values.schema.json"
    assert json.loads(path.read_text()) == synced_values_schema(path), (
        "stale: run python3 -m disagg.launch.deploy sync-schema helm/disagg/values.schema.json")


@pytest.mark.parametrize("bad, where", [
    ({"app": {"engine": {"blok_size": 64}}}, "/app/engine"),
    ({"app": {"router": {"policy": "random"}}}, "/app/router/policy"),
    ({"app": {"deployment": {"decode": {"max_replicas": "many"}}}}, "/app/deployment/decode/max_replicas"),
    ({"gpu": {"resourceName": "intel.com/gpu"}}, "/gpu/resourceName"),
    ({"image": {"repository": "x", "tag": "latest"}}, "/image/tag"),
    ({"workerGroups": [{"name": "w", "role": "both", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "gpus": 0,
                        "cpus": 1, "memoryGi": 4, "objectStoreGi": 1}]}, "/workerGroups/0/role"),
    ({"replicaCount": 3}, "replicaCount"),
])
def test_schema_rejects_bad_values(bad, where):
    with pytest.raises(HelmValuesError) as err:
        render(bad)
    assert where in str(err.value)


def _group(**kw):
    g = {"name": "w", "role": "mixed", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "gpus": 8, "cpus": 64,
         "memoryGi": 512, "objectStoreGi": 64, "shmHeadroomGi": 4}
    return dict(g, **kw)


@pytest.mark.parametrize("override, message", [
    ({"workerGroups": [_group(memoryGi=300)]}, "must exceed the memory-backed /dev/shm"),  # 64 + 256 + 4 GiB
    ({"workerGroups": [_group(minReplicas=2, replicas=1, maxReplicas=3)]}, "minReplicas <= replicas <= maxReplicas"),
    ({"workerGroups": [_group(name="a"), _group(name="a")]}, "is used twice"),
    ({"workerGroups": [_group(role="decode")]}, "no worker group can run prefill replicas"),
    ({"workerGroups": [_group(maxReplicas=3)]}, "the app asks for up to 32 GPUs but the worker groups hold at most 24"),
    ({"workerGroups": [_group(role="prefill", maxReplicas=1), _group(name="d", role="decode", maxReplicas=2)]},
     "app.deployment.decode asks for up to 24 GPUs"),
    ({"apiKey": {"existingSecret": "", "create": True, "keys": []}}, "apiKey.create needs at least one key"),
    ({"apiKey": {"existingSecret": "s", "create": True, "keys": ["k" * 16]}}, "set existingSecret or create, not both"),
])
def test_render_refuses_unschedulable_or_inconsistent_values(override, message):
    """Cross-field checks in templates/_validate.tpl fail the render with the values to fix."""
    values = merge(example_values("mi355x"), {k: v for k, v in override.items() if k != "workerGroups"})
    if "workerGroups" in override:
        values["workerGroups"] = override["workerGroups"]
    with pytest.raises(HelmError) as err:
        render(values)
    assert message in str(err.value)


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_serve_config_is_accepted_by_the_app_builder(rendered, example):
    """serveConfigV2 passes Ray's ServeDeploySchema and disagg's load_config, and holds exactly
    the app values plus what the chart owns (HTTP edge, key file, role resources)."""
    values = merge(render_defaults(), example_values(example))
    rs = one(rendered[example], "RayService")
    config = serve_config(rs)
    cfg = validate_serve_config(config)  # ServeDeploySchema + load_config, as build_app parses its args
    assert load_config(config) == cfg
    app = config["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    assert config["http_options"] == {"host": "0.0.0.0", "port": values["serve"]["port"]}
    expected = AppConfig.model_validate(values["app"])
    expected.http.host, expected.http.port = "0.0.0.0", values["serve"]["port"]
    if values["apiKey"]["existingSecret"] or values["apiKey"]["create"]:
        expected.http.api_keys_file = f"/etc/disagg/api-keys/{values['apiKey']['secretKey']}"
    expected.deployment.prefill.resources["disagg_prefill"] = 1
    expected.deployment.decode.resources["disagg_decode"] = 1
    assert cfg == expected


def render_defaults() -> dict:
    from helm_python import Chart

    with Chart.load(CHART) as c:
        return c.values


def test_replicas_ask_for_their_group_resource(rendered):
    """deployment_options (the code build_app runs) turns the role resources into Ray actor options."""
    from deployments.app import deployment_options

    cfg = validate_serve_config(serve_config(one(rendered["mi355x-dedicated"], "RayService")))
    prefill = deployment_options(cfg.deployment.prefill, cfg)["ray_actor_options"]
    decode = deployment_options(cfg.deployment.decode, cfg)["ray_actor_options"]
    assert prefill["resources"] == {"disagg_prefill": 1} and prefill["num_gpus"] == 1
    assert decode["resources"] == {"disagg_decode": 1}
    assert prefill["accelerator_type"] == "AMD-Instinct-MI355X-OAM"


@pytest.mark.parametrize("example, expected", [
    ("mi355x", {"mi355x": {"disagg_prefill": 1000, "disagg_decode": 1000,
                           "accelerator_type:AMD-Instinct-MI355X-OAM": 1}}),
    ("mi355x-dedicated", {"prefill": {"disagg_prefill": 1000, "accelerator_type:AMD-Instinct-MI355X-OAM": 1},
                          "decode": {"disagg_decode": 1000, "accelerator_type:AMD-Instinct-MI355X-OAM": 1}}),
    ("cpu-smoke", {"cpu": {"disagg_prefill": 1000, "disagg_decode": 1000}}),
])
def test_worker_groups_advertise_role_and_accelerator(rendered, example, expected):
    groups = worker_groups(one(rendered[example], "RayService"))
    assert {name: ray_resources_param(g["rayStartParams"]["resources"]) for name, g in groups.items()} == expected


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_dev_shm_holds_object_store_and_host_tier(rendered, example):
    """Each pod's memory-backed /dev/shm fits the object store plus the host tier, and the pod's
    memory limit (which tmpfs pages count against) exceeds it."""
    values = merge(render_defaults(), example_values(example))
    host_bytes = values["app"]["transfer"]["host"]["capacity_mb"] << 20
    rs = one(rendered[example], "RayService")
    for name, tpl in pod_templates(rs).items():
        shm = next(v for v in tpl["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"]
        assert shm["medium"] == "Memory"
        mount = next(m for m in tpl["spec"]["containers"][0]["volumeMounts"] if m["name"] == "dshm")
        assert mount["mountPath"] == "/dev/shm"
        limit = gi(tpl["spec"]["containers"][0]["resources"]["limits"]["memory"])
        assert gi(shm["sizeLimit"]) < limit, name
        if name == "head":
            continue
        group = worker_groups(rs)[name]
        object_store = int(group["rayStartParams"]["object-store-memory"])
        assert gi(shm["sizeLimit"]) * GIB >= object_store + host_bytes, name
        spec = next(g for g in values["workerGroups"] if g["name"] == name)
        assert gi(shm["sizeLimit"]) == spec["objectStoreGi"] + math.ceil(host_bytes / GIB) + spec["shmHeadroomGi"]


@pytest.mark.parametrize("example, resource, count", [
    ("mi355x", "amd.com/gpu", 8), ("cpu-smoke", None, 0), ("defaults", None, 0)])
def test_gpu_requests(rendered, example, resource, count):
    rs = one(rendered[example], "RayService")
    for group in worker_groups(rs).values():
        res = group["template"]["spec"]["containers"][0]["resources"]
        gpu_keys = {k for k in res["limits"] if k.endswith("/gpu")}
        assert gpu_keys == ({resource} if resource else set())
        if resource:
            assert res["limits"][resource] == res["requests"][resource] == count
        assert group["rayStartParams"]["num-gpus"] == str(count)


def test_nvidia_resource_name():
    values = merge(example_values("mi355x"), {"gpu": {"resourceName": "nvidia.com/gpu", "acceleratorType": "H100"}})
    rs = one(render_objects(values), "RayService")
    res = worker_groups(rs)["mi355x"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 8 and "amd.com/gpu" not in res["limits"]
    assert "accelerator_type:H100" in ray_resources_param(worker_groups(rs)["mi355x"]["rayStartParams"]["resources"])


def test_node_placement_and_autoscaling_bounds(rendered):
    rs = one(rendered["mi355x"], "RayService")
    rc = rs["spec"]["rayClusterConfig"]
    group = worker_groups(rs)["mi355x"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 1, 4)
    assert rc["enableInTreeAutoscaling"] is True
    spec = group["template"]["spec"]
    assert spec["nodeSelector"] == {"amd.com/gpu.product-name": "AMD_Instinct_MI355X_OAM"}
    assert spec["tolerations"] == [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    smoke = one(rendered["cpu-smoke"], "RayService")["spec"]["rayClusterConfig"]
    assert smoke["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in smoke


def test_api_key_secret_is_mounted_where_the_app_reads_it(rendered, tmp_path):
    objs = rendered["cpu-smoke"]
    secret = one(objs, "Secret")
    rs = one(objs, "RayService")
    keys_file = validate_serve_config(serve_config(rs)).http.api_keys_file
    for tpl in pod_templates(rs).values():
        mount = next(m for m in tpl["spec"]["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
        volume = next(v for v in tpl["spec"]["volumes"] if v["name"] == "api-keys")["secret"]
        assert mount["readOnly"] is True and volume["secretName"] == secret["metadata"]["name"]
        assert f"{mount['mountPath']}/{volume['items'][0]['path']}" == keys_file
        assert not any("API" in e["name"] for e in tpl["spec"]["containers"][0]["env"])  # never an env var
    # what the app reads from that file: the Secret's data, one key a line
    data = secret["stringData"][volume["items"][0]["key"]]
    (tmp_path / "keys").write_text(data)
    cfg = validate_serve_config(serve_config(rs)).http.model_copy(update={"api_keys_file": str(tmp_path / "keys")})
    assert cfg.with_file_keys().api_keys == ["smoke-test-key-0001"]


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_ray_env_is_the_serve_env_of_disagg_serve(rendered, example):
    for name, tpl in pod_templates(one(rendered[example], "RayService")).items():
        env = {e["name"]: e["value"] for e in tpl["spec"]["containers"][0]["env"]}
        shim = env.pop("RAY_SERVE_HAPROXY_BINARY_PATH")
        assert env == {**SERVE_ENV, **NODE_ENV}, name  # the settings `disagg serve` uses
        mount = next(m for m in tpl["spec"]["containers"][0]["volumeMounts"] if m["name"] == "haproxy-front")
        assert shim == mount["mountPath"] + "/haproxy-front" and mount["readOnly"] is True, name


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_haproxy_starts_through_the_mounted_loopback_stats_shim(rendered, example):
    cm = next(o for o in rendered[example] if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-haproxy"))
    assert cm["data"]["haproxy-front"] == (CHART.parents[1] / "deployments" / "cluster" / "haproxy-front").read_text()
    for name, tpl in pod_templates(one(rendered[example], "RayService")).items():
        volume = next(v for v in tpl["spec"]["volumes"] if v["name"] == "haproxy-front")["configMap"]
        assert volume["name"] == cm["metadata"]["name"], name
        assert volume["defaultMode"] == 0o555, name  # executable: Serve runs it as HAProxy


def test_ingress_and_service_monitor_point_at_the_serve_service(rendered):
    objs = rendered["mi355x"]
    rs, ingress, monitor = one(objs, "RayService"), one(objs, "Ingress"), one(objs, "ServiceMonitor")
    svc = rs["spec"]["serveService"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": svc["metadata"]["name"], "port": {"name": "serve"}}
    assert [p["name"] for p in svc["spec"]["ports"]] == ["serve"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "serve", "path": "/metrics", "interval": "15s"}]


def test_disk_tier_volume(rendered):
    values = example_values("mi355x")
    tpl = pod_templates(one(rendered["mi355x"], "RayService"))["mi355x"]
    volume = next(v for v in tpl["spec"]["volumes"] if v["name"] == "disk-tier")
    mount = next(m for m in tpl["spec"]["containers"][0]["volumeMounts"] if m["name"] == "disk-tier")
    assert volume["hostPath"]["path"] == values["diskTier"]["hostPath"]
    assert mount["mountPath"] == values["app"]["transfer"]["disk"]["path"]
    smoke = pod_templates(one(rendered["cpu-smoke"], "RayService"))["cpu"]
    sized = next(v for v in smoke["spec"]["volumes"] if v["name"] == "disk-tier")["emptyDir"]
    assert gi(sized["sizeLimit"]) >= 1.05 * example_values("cpu-smoke")["app"]["transfer"]["disk"]["capacity_gb"]
    assert all(v["name"] != "disk-tier" for v in pod_templates(one(rendered["mi355x"], "RayService"))["head"]
               ["spec"]["volumes"])


def test_dashboard_config_map_carries_the_dashboard(rendered):
    cm = next(o for o in rendered["mi355x"] if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["disagg.json"]) == json.loads((CHART / "dashboards" / "disagg.json").read_text())


def test_notes_name_the_objects_to_reach():
    notes = render(example_values("cpu-smoke"))["disagg/templates/NOTES.txt"]
    assert "kubectl -n llm get rayservice k3-disagg" in notes
    assert "port-forward svc/k3-disagg-serve 8000:8000" in notes
    assert "cpu (mixed): 1..1 pods x 0 GPUs, /dev/shm 3Gi" in notes
