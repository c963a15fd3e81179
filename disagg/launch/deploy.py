"""Deploy the application onto a running Ray cluster (``disagg deploy``).

A cluster started with ``ray up`` (see ``deployments/cluster/``) serves whatever
Serve config its dashboard receives. This module turns an ``AppConfig`` or a Serve
config YAML into the config ``serve deploy`` sends (``import_path:
deployments.app:build_app``, ``args:`` = the AppConfig), checks it the way Ray does
(``ServeDeploySchema``) and the way the app builder does (``load_config``), and
sends it to the dashboard's REST API, as ``serve deploy`` does.

    disagg deploy --config deployments/cluster/serve/mi355x-cluster.yaml \\
        --address http://HEAD:8265 --set deployment.decode.max_replicas=32

``--set KEY=VALUE`` edits the AppConfig (dotted path under ``args``; the value is
parsed as YAML). ``--dry-run`` prints the config instead of sending it.

The Helm chart's ``values.schema.json`` embeds the AppConfig's JSON schema so that
``helm install`` rejects a mistyped ``app:`` key before anything starts;
``python3 -m disagg.launch.deploy sync-schema helm/disagg/values.schema.json`` rewrites it
after the config changes (a test fails while it is stale).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from disagg.config import AppConfig

APP_NAME = "disagg"
IMPORT_PATH = "deployments.app:build_app"
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


def parse_set(item: str) -> tuple[list[str], Any]:
    """``"a.b.c=VALUE"`` -> (["a", "b", "c"], VALUE parsed as YAML)."""
    key, sep, raw = item.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ValueError(f"--set needs KEY.PATH=VALUE, got {item!r}")
    return path, yaml.safe_load(raw) if raw.strip() else ""


def apply_sets(args: dict, sets: list[str]) -> dict:
    """A copy of ``args`` with each ``KEY.PATH=VALUE`` applied (intermediate maps created)."""
    out = copy.deepcopy(args)
    for item in sets:
        path, value = parse_set(item)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a mapping")
            node = child
        node[path[-1]] = value
    return out


def build_serve_config(source: str | Path | dict, sets: list[str] | None = None) -> dict:
    """The ``serve deploy`` config for ``source`` (an AppConfig or a Serve config).

    A Serve config keeps its own top level (proxy location, HTTP options, the app's
    name, route prefix, runtime env); a bare AppConfig gets the defaults below. The
    app's ``args`` are validated as an AppConfig and written back as given (unset
    fields stay unset, so the file reads like its source).

    Raises:
        ValueError: the file or an override is malformed, names another app
            builder, or the args are not a valid AppConfig.
    """
    data = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping at the top level")
    if "applications" in data:
        config = copy.deepcopy(data)
        apps = config["applications"]
        if not isinstance(apps, list) or len(apps) != 1:
            raise ValueError("a disagg Serve config holds exactly one application")
        app = apps[0]
        if app.get("import_path", IMPORT_PATH) != IMPORT_PATH:
            raise ValueError(f"application import_path must be {IMPORT_PATH!r}, got {app['import_path']!r}")
    else:
        config = {"proxy_location": "EveryNode", "applications": [{"name": APP_NAME, "route_prefix": "/"}]}
        app = config["applications"][0]
        app["args"] = data
    app["import_path"] = IMPORT_PATH
    args = apply_sets(app.get("args") or {}, sets or [])
    cfg = AppConfig.model_validate(args)  # what build_app does with these args
    app["args"] = cfg.model_dump(mode="json", exclude_unset=True)
    http = config.setdefault("http_options", {})
    http.setdefault("host", cfg.http.host)
    http.setdefault("port", cfg.http.port)
    validate_serve_config(config)
    return config


def validate_serve_config(config: dict) -> AppConfig:
    """Check ``config`` as Ray's ``serve deploy`` and the app builder would; returns the AppConfig.

    Raises:
        ValueError: Ray's ``ServeDeploySchema`` or ``AppConfig`` rejects it.
    """
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        raise ValueError(f"not a valid Serve deploy config: {exc}") from exc
    from disagg.config import load_config

    try:
        return load_config(config)
    except ValidationError as exc:
        raise ValueError(f"application args are not a valid AppConfig: {exc}") from exc


def send(config: dict, address: str = DEFAULT_DASHBOARD) -> None:
    """PUT ``config`` to the Ray dashboard at ``address`` (what ``serve deploy`` does).

    This replaces every Serve application on that cluster with the ones in ``config``.
    """
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    ServeSubmissionClient(address).deploy_applications(config)


def run_deploy(source: str, sets: list[str], address: str, output: str | None = None,
               dry_run: bool = False) -> int:
    """``disagg deploy``: build, check, optionally write, then send (unless ``dry_run``)."""
    try:
        config = build_serve_config(source, sets)
    except (OSError, ValueError) as exc:
        print(f"disagg deploy: {exc}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(config, sort_keys=False)
    if output:
        Path(output).write_text(text)
    if dry_run:
        if not output:
            print(text, end="")
        return 0
    try:
        send(config, address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"disagg deploy: {address}: {exc}", file=sys.stderr)
        return 1
    print(f"sent the Serve config to {address}; follow it with: serve status --address {address}")
    return 0


# -- the Helm chart's values schema ------------------------------------------------------

def app_schema_defs() -> dict:
    """JSON-schema ``$defs`` for the chart's ``app:`` value: the AppConfig model and its parts."""
    schema = AppConfig.model_json_schema()
    defs = schema.pop("$defs")
    defs["AppConfig"] = schema
    return defs


def synced_values_schema(path: str | Path) -> dict:
    """The chart's values schema at ``path`` with its ``$defs`` regenerated from AppConfig."""
    schema = json.loads(Path(path).read_text())
    schema["$defs"] = app_schema_defs()
    return schema


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "sync-schema":
        print("usage: python3 -m disagg.launch.deploy sync-schema helm/disagg/values.schema.json", file=sys.stderr)
        return 2
    schema = synced_values_schema(argv[1])
    Path(argv[1]).write_text(json.dumps(schema, indent=2) + "\n")
    print(f"wrote {argv[1]} ({len(schema['$defs'])} definitions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
