"""Rendered objects against Kubernetes' own OpenAPI-derived JSON schemas (the strict
variants bundled by the kubernetes-validate package: unknown fields are errors), and
the custom resources against schemas written from their CRDs (tests/deploy/schemas)."""

from __future__ import annotations

import copy
import json
from importlib.resources import files

import jsonschema
import kubernetes_validate
import pytest
from referencing import Registry, Resource

from tests.deploy.chart import EXAMPLES, SCHEMAS, example_values, one, pod_templates, render_objects

KUBE_VERSION = "1.30.0"  # the oldest Kubernetes the examples target (Chart.yaml asks >= 1.25)
CORE_KINDS = {"Secret", "Ingress", "ConfigMap", "NetworkPolicy", "Service"}
CRD_SCHEMAS = {"RayService": "rayservice.ray.io_v1.json", "ServiceMonitor": "servicemonitor.monitoring.coreos.com_v1.json"}


def _k8s_definition_validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for one definition (e.g. io.k8s.api.core.v1.PodTemplateSpec) of the strict schemas."""
    path = f"kubernetes-json-schema/v{KUBE_VERSION}-local-strict/_definitions.json"
    defs = json.loads(files("kubernetes_validate").joinpath(path).read_text())
    registry = Resource.from_contents(defs) @ Registry()
    return jsonschema.Draft202012Validator({"$ref": f"{defs['$id']}#/$defs/{name}"}, registry=registry)


POD_TEMPLATE = _k8s_definition_validator("io.k8s.api.core.v1.PodTemplateSpec")
RESOURCE_REQUIREMENTS = _k8s_definition_validator("io.k8s.api.core.v1.ResourceRequirements")
SECURITY_CONTEXT = _k8s_definition_validator("io.k8s.api.core.v1.SecurityContext")


def _crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / CRD_SCHEMAS[kind]).read_text()))


@pytest.fixture(scope="module", params=list(EXAMPLES))
def objs(request) -> list[dict]:
    return render_objects(example_values(request.param))


def test_core_objects_validate(objs):
    core = [o for o in objs if o["kind"] in CORE_KINDS]
    assert core, "every example renders at least one core object"
    for obj in core:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_custom_resources_validate(objs):
    kinds = {o["kind"] for o in objs}
    assert kinds <= CORE_KINDS | set(CRD_SCHEMAS), f"no schema for {kinds - CORE_KINDS - set(CRD_SCHEMAS)}"
    for obj in objs:
        if obj["kind"] in CRD_SCHEMAS:
            _crd_validator(obj["kind"]).validate(obj)


def test_ray_pods_and_serve_service_validate(objs):
    """What the RayService embeds is core Kubernetes: its pod templates, the serve Service,
    the autoscaler sidecar's resources and security context."""
    rs = one(objs, "RayService")
    for name, tpl in pod_templates(rs).items():
        errors = [e.message for e in POD_TEMPLATE.iter_errors(tpl)]
        assert errors == [], f"{name}: {errors}"
    service = dict(rs["spec"]["serveService"], apiVersion="v1", kind="Service")
    kubernetes_validate.validate(service, KUBE_VERSION, strict=True)
    opts = rs["spec"]["rayClusterConfig"].get("autoscalerOptions")
    if opts:
        RESOURCE_REQUIREMENTS.validate(opts["resources"])
        SECURITY_CONTEXT.validate(opts["securityContext"])


def test_the_validators_reject_mistakes():
    """The schemas are strict enough to catch the mistakes a template edit makes."""
    rs = one(render_objects(example_values("mi355x")), "RayService")
    tpl = copy.deepcopy(pod_templates(rs)["mi355x"])
    tpl["spec"]["containers"][0]["volumeMount"] = []  # misspelled field
    assert not POD_TEMPLATE.is_valid(tpl)
    tpl = copy.deepcopy(pod_templates(rs)["mi355x"])
    tpl["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = ["392Gi"]  # wrong type
    assert not POD_TEMPLATE.is_valid(tpl)
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4  # not a KubeRay field
    assert not _crd_validator("RayService").is_valid(bad)
    bad = copy.deepcopy(rs)
    del bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"]  # required by the CRD
    assert not _crd_validator("RayService").is_valid(bad)
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    assert not _crd_validator("RayService").is_valid(bad)
    ingress = copy.deepcopy(one(render_objects(example_values("mi355x")), "Ingress"))
    ingress["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ingress, KUBE_VERSION, strict=True)
