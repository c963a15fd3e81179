"""Security scan of the rendered chart with checkov (PyPI), every example values file.

checkov runs from its own virtual environment: it pins older releases of packages this
project also uses (packaging 23.2, boto3 1.35, networkx 2.6, ...), and installing it next
to the project would downgrade them. The venv holds exactly checkov-requirements.txt
(pinned, so a new checkov release cannot change the verdict unannounced). The test never
installs it: ``.ci/run`` makes that venv and passes its checkov in DISAGG_CHECKOV; by hand::

    python3 -m venv /tmp/checkov
    /tmp/checkov/bin/pip install --no-deps -r tests/deploy/checkov-requirements.txt
    DISAGG_CHECKOV=/tmp/checkov/bin/checkov pytest tests/deploy/test_checkov.py

Without it the scan is skipped, saying so; under CI (CI=true) it fails instead, since a CI
run that silently skipped the scan would pass a chart nobody scanned.

checkov has no schema for KubeRay's RayService, so the Ray pods are also written out as
plain Pods (the head and each worker group template, annotations included) for its
Kubernetes checks to reach them. A finding is either fixed in the chart or skipped with
a justification in the pod template (templates/_pod.tpl); the test accepts no failure
and no unjustified skip. checkov's open-source checks carry no severity, so "no high
finding" is enforced as "no finding".
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml

from tests.deploy.chart import (
    CHART,
    EXAMPLES,
    NAMESPACE,
    RELEASE,
    example_values,
    pod_templates,
    render_objects,
)


def _checkov() -> str:
    exe = os.environ.get("DISAGG_CHECKOV", "")
    if exe and os.access(exe, os.X_OK):
        return exe
    why = (f"DISAGG_CHECKOV={exe!r} is not an executable" if exe else "DISAGG_CHECKOV is not set")
    how = ("make a venv with `pip install --no-deps -r tests/deploy/checkov-requirements.txt` and set "
           "DISAGG_CHECKOV to its bin/checkov (.ci/run does)")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"checkov scan cannot run under CI: {why}; {how}")
    pytest.skip(f"checkov not set up: {why}; {how}")


def _as_pods(rayservice: dict) -> list[dict]:
    pods = []
    for name, tpl in pod_templates(rayservice).items():
        meta = dict(tpl["metadata"], name=f"{rayservice['metadata']['name']}-{name}",
                    namespace=rayservice["metadata"]["namespace"])
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": tpl["spec"]})
    return pods


def _justified_checks() -> set[str]:
    """The check ids the pod template's notes list as exceptions (each at the start of a line)."""
    text = (CHART / "templates" / "_pod.tpl").read_text()
    notes = text[text.index("Security scan exceptions"):text.index("Not skipped:")]
    heads = re.findall(r"^  (CKV_K8S_\d+(?:, CKV_K8S_\d+)*)", notes, flags=re.M)
    return {check for head in heads for check in head.split(", ")}


@pytest.fixture(scope="module")
def scan(tmp_path_factory) -> dict:
    exe = _checkov()
    root = tmp_path_factory.mktemp("manifests")
    num_pods = 0
    for example in EXAMPLES:
        objs = render_objects(example_values(example))
        pods = [p for o in objs if o["kind"] == "RayService" for p in _as_pods(o)]
        num_pods += len(pods)
        (root / f"{example}.yaml").write_text(yaml.safe_dump_all(objs + pods))
    proc = subprocess.run([exe, "-d", str(root), "--framework", "kubernetes", "--skip-download", "-o", "json",
                           "--compact"], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, LOG_LEVEL="ERROR"))
    assert proc.stdout.strip(), f"checkov printed nothing (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    (report,) = [r for r in reports if r.get("check_type") == "kubernetes"]
    return {"report": report, "num_pods": num_pods}


def test_no_failed_checks(scan):
    failed = [f"{c['check_id']} {c['resource']}: {c['check_name']}" for c in scan["report"]["results"]["failed_checks"]]
    assert failed == []


def test_every_skip_is_justified_in_the_chart(scan):
    allowed = _justified_checks()
    skipped = scan["report"]["results"]["skipped_checks"]
    assert skipped, "expected the documented exceptions to show up as skips"
    for c in skipped:
        assert c["check_id"] in allowed, f"{c['check_id']} skipped on {c['resource']} but not justified in _pod.tpl"
        comment = c["check_result"].get("suppress_comment") or ""
        assert len(comment) > 20, f"{c['check_id']} on {c['resource']}: no justification"


def test_the_ray_pods_were_scanned(scan):
    """Not vacuous: checkov evaluated container checks on every Ray pod and they passed."""
    passed = scan["report"]["results"]["passed_checks"]
    pods = {(c["file_path"], c["resource"]) for c in passed if c["resource"].startswith("Pod.")}
    assert len(pods) == scan["num_pods"] > 0
    # privilege escalation, NET_RAW, capabilities, memory limits, secrets as files
    for check in ("CKV_K8S_20", "CKV_K8S_28", "CKV_K8S_37", "CKV_K8S_13", "CKV_K8S_35"):
        assert {(c["file_path"], c["resource"]) for c in passed if c["check_id"] == check} >= pods, check
    assert f"Pod.{NAMESPACE}.{RELEASE}-disagg-head" in {resource for _, resource in pods}
