"""Render the Helm chart with Helm's own engine (helm-python-sdk, no helm binary) for tests."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "disagg"
EXAMPLES_DIR = CHART / "examples"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE, NAMESPACE = "k3", "llm"

# example id -> values files, applied in order as `helm -f a -f b` does
EXAMPLES = {
    "defaults": [],
    "cpu-smoke": ["values-cpu-smoke.yaml"],
    "mi355x": ["values-mi355x.yaml"],
    "mi355x-dedicated": ["values-mi355x.yaml", "values-mi355x-dedicated-pools.yaml"],
}


def merge(base: dict, over: dict) -> dict:
    """Helm's coalescing of values files: maps merge key by key, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def example_values(example: str) -> dict:
    values: dict = {}
    for name in EXAMPLES[example]:
        values = merge(values, yaml.safe_load((EXAMPLES_DIR / name).read_text()) or {})
    return values


def render(values: dict | None = None) -> dict[str, str]:
    """{template path: rendered text}; raises helm_python's HelmError on schema or template failures."""
    from helm_python import Chart

    with Chart.load(CHART) as chart:
        return chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE)


def objects(rendered: dict[str, str]) -> list[dict]:
    """The Kubernetes objects among the rendered templates (NOTES.txt excluded)."""
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def render_objects(values: dict | None = None) -> list[dict]:
    return objects(render(values))


def one(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_templates(rayservice: dict) -> dict[str, dict]:
    """{"head" or worker group name: pod template} of a rendered RayService."""
    rc = rayservice["spec"]["rayClusterConfig"]
    out = {"head": rc["headGroupSpec"]["template"]}
    for group in rc.get("workerGroupSpecs", []):
        out[group["groupName"]] = group["template"]
    return out


def worker_groups(rayservice: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])}


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def ray_resources_param(value: str) -> dict:
    """Decode a rayStartParams ``resources`` value as ``ray start --resources=<value>`` sees it.

    KubeRay writes the value into the shell command line as is, so it carries its own
    shell quoting: '"{\\"disagg_prefill\\": 1000}"'.
    """
    words = shlex.split(value)
    assert len(words) == 1, f"resources must be one shell word, got {value!r}"
    return json.loads(words[0])


def gi(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2])
