"""The suite writes only inside the checkout and the temp dir (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def test_library_caches_go_to_the_temp_dir_not_home() -> None:
    """matplotlib (imported by disagg.tools.bench.plots) would cache fonts under ~/.cache; a child
    process, as the CLI tests start, inherits the same redirection."""
    code = "import matplotlib; print(matplotlib.get_cachedir()); print(matplotlib.get_configdir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, HOME=str(Path.home())))
    temp, home = Path(tempfile.gettempdir()).resolve(), Path.home().resolve()
    for where in out.stdout.split():
        path = Path(where).resolve()
        assert path.is_relative_to(temp) and not path.is_relative_to(home), where
