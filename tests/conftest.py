"""Session settings for every test directory.

The process ends with pytest's own exit status as soon as pytest has reported and every
plugin has unconfigured, without the interpreter's finalization. The suite starts local Ray
clusters, gRPC servers, shared-memory arenas, NIXL/UCX agents and torch thread pools in this
process; their native threads can still be running while the interpreter tears itself down,
and a crash there (seen once in CI: a SIGSEGV after the summary line, not reproduced since)
turned a reported result into exit 139. By then every result is reported and every fixture
torn down, so skipping finalization loses nothing; a crash during a test still shows (pytest's
faulthandler prints its traceback) and still fails the run.
"""

from __future__ import annotations

import os
import sys

import pytest

_SESSION = pytest.StashKey[pytest.Session]()


def pytest_sessionstart(session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is None or os.environ.get("DISAGG_TEST_FINALIZE"):  # DISAGG_TEST_FINALIZE=1: exit normally
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))
