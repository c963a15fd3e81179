"""The Grafana dashboard (helm/disagg/dashboards/disagg.json) queries what the app exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import Counter, Gauge, Histogram

from disagg.api.metrics import ServingMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "disagg" / "dashboards" / "disagg.json"
# the families the dashboard was built for: each needs at least one panel
CHARTED = {"disagg_ttft_seconds", "disagg_itl_seconds", "disagg_e2e_seconds", "disagg_requests",
           "disagg_prompt_tokens", "disagg_generation_tokens", "disagg_transfer_bytes", "disagg_transfer_seconds",
           "disagg_tier_used_bytes", "disagg_tier_capacity_bytes", "disagg_tier_objects", "disagg_tier_evictions",
           "disagg_checksum_failures", "disagg_route_cached_tokens", "disagg_engine_requests",
           "disagg_route_decisions", "disagg_route_pool_views"}


def _exported() -> dict[str, tuple[str, set[str]]]:
    """{series name as Prometheus stores it: (family, label names)} of ServingMetrics."""
    out = {}
    for metric in vars(ServingMetrics()).values():
        if not isinstance(metric, Counter | Gauge | Histogram):
            continue
        family, labels = metric._name, set(metric._labelnames)
        if isinstance(metric, Counter):
            out[family + "_total"] = (family, labels)
        elif isinstance(metric, Histogram):
            for suffix in ("_bucket", "_sum", "_count"):
                out[family + suffix] = (family, labels | {"le"})
        else:
            out[family] = (family, labels)
    return out


def _targets() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


EXPORTED = _exported()


@pytest.mark.parametrize("title, expr", _targets())
def test_queries_name_exported_series_and_labels(title, expr):
    names = set(re.findall(r"\bdisagg_\w+", expr))
    assert names, f"{title}: queries no disagg series"
    unknown = names - set(EXPORTED)
    assert not unknown, f"{title}: {sorted(unknown)} not exported (exported: {sorted(EXPORTED)})"
    labels = set().union(*(EXPORTED[n][1] for n in names))
    used = {lbl.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for lbl in group.split(",") if lbl.strip()}
    used |= set(re.findall(r"[{,]\s*(\w+)\s*=~?", expr))
    assert used <= labels, f"{title}: labels {sorted(used - labels)} are not on {sorted(names)}"
    assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]")


def test_every_charted_family_has_a_panel():
    queried = {EXPORTED[n][0] for _, expr in _targets() for n in re.findall(r"\bdisagg_\w+", expr)}
    assert CHARTED <= queried, sorted(CHARTED - queried)


def test_dashboard_shape():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
