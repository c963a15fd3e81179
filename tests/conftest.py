"""Session settings for every test directory.

The process ends with pytest's own exit status as soon as pytest has reported and every
plugin has unconfigured, without the interpreter's finalization. The suite starts local Ray
clusters, gRPC servers, shared-memory arenas, NIXL/UCX agents and torch thread pools in this
process; their native threads can still be running while the interpreter tears itself down,
and a crash there (seen once in CI: a SIGSEGV after the summary line, not reproduced since)
turned a reported result into exit 139. By then every result is reported and every fixture
torn down, so skipping finalization loses nothing; a crash during a test still shows (pytest's
faulthandler prints its traceback) and still fails the run.

Tests write only inside the checkout and the temp dir. Libraries that keep caches or
settings under the home directory (matplotlib's font cache and config dir, and anything
else that follows XDG) get directories in a temp dir of this run instead, removed at the end;
processes the tests start inherit them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

_SESSION = pytest.StashKey[pytest.Session]()
_HOME_DIRS = tempfile.mkdtemp(prefix="disagg-test-home-")
for _var in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "MPLCONFIGDIR"):
    os.environ[_var] = os.path.join(_HOME_DIRS, _var.lower())


def pytest_sessionstart(session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    shutil.rmtree(_HOME_DIRS, ignore_errors=True)
    session = config.stash.get(_SESSION, None)
    if session is None or os.environ.get("DISAGG_TEST_FINALIZE"):  # DISAGG_TEST_FINALIZE=1: exit normally
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))
