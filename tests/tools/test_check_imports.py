"""The import layering holds and there is no import cycle (``tools/check_imports.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import check_imports  # noqa: E402


def test_the_code_base_has_no_upward_import_and_no_cycle():
    assert check_imports.check(ROOT) == []


def test_the_script_exits_zero_on_this_tree():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_imports.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for pkg in check_imports.PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("importer, text, layers", [
    ("kv_transfer/codec.py", "from disagg.config import AppConfig\n", "(transfer) -> disagg.config (core)"),
    ("disagg/workers/tiered.py", "def f():\n    from deployments.app import build_app\n", "(core) -> deployments.app (serving)"),
    ("disagg/router/x.py", "import disagg.tools.bench.trace\n", "(core) -> disagg.tools.bench.trace (tools)"),
    ("disagg/tools/sim/x.py", "from deployments import app\n", "(tools) -> deployments.app (serving)"),
    ("deployments/app.py", "from disagg.launch.local import SERVE_ENV\n", "(serving) -> disagg.launch.local (launchers)"),
    ("disagg/engine/x.py", "from ..launch.cli import main\n", "(core) -> disagg.launch.cli (launchers)"),
])
def test_an_upward_import_is_reported(tmp_path, importer, text, layers):
    files = {"disagg/config.py": "", "disagg/launch/cli.py": "", "disagg/launch/local.py": "", "disagg/tools/bench/trace.py": "",
             "disagg/engine/__init__.py": "", "deployments/app.py": "", importer: text}
    (line,) = check_imports.check(_tree(tmp_path, files))
    assert line.startswith(f"upward import: {importer}:") and line.endswith(layers)


def test_downward_and_sideways_imports_pass(tmp_path):
    files = {"disagg/config.py": "import kv_transfer.keys\n", "kv_transfer/keys.py": "",
             "disagg/launch/cli.py": "from deployments.app import x\nfrom disagg.tools.sim import y\n",
             "deployments/app.py": "from disagg.config import AppConfig\n", "disagg/tools/sim/__init__.py": "",
             "disagg/tools/sim/y.py": "from disagg.config import AppConfig\n"}
    assert check_imports.check(_tree(tmp_path, files)) == []


def test_a_cycle_is_reported_even_through_type_checking_imports(tmp_path):
    files = {"disagg/router/__init__.py": "",
             "disagg/router/a.py": "from disagg.router.b import B\n",
             "disagg/router/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
             "disagg/router/c.py": "def f():\n    from disagg.router import a\n"}
    assert check_imports.check(_tree(tmp_path, files)) == [
        "import cycle: disagg.router.a <-> disagg.router.b <-> disagg.router.c"]


def test_two_packages_importing_each_other_are_a_cycle_without_a_module_cycle(tmp_path):
    """engine.x -> flow and flow -> engine.y: no module loop, but the packages depend on each other."""
    files = {"disagg/engine/__init__.py": "", "disagg/engine/x.py": "import disagg.flow\n",
             "disagg/engine/y.py": "", "disagg/flow.py": "from disagg.engine.y import Y\n"}
    assert check_imports.check(_tree(tmp_path, files)) == ["package cycle (depth 2): disagg.engine <-> disagg.flow"]


def test_serving_and_the_cli_do_not_import_the_report_libraries():
    """matplotlib and pyarrow are the tools' (plots, parquet reports), imported where a plot or a
    report is written: starting the server or the CLI does not pay for them."""
    code = ("import sys\n"
            "import deployments.app, disagg.launch.cli, disagg.api.app, disagg.workers.tiered\n"
            "import disagg.tools.bench.runner, disagg.tools.sim.cli\n"
            "print(sorted(m for m in ('matplotlib', 'pyarrow') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
