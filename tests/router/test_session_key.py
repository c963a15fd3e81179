"""One session identity for the worker, the router and the Serve affinity router."""

from __future__ import annotations

import pytest

from disagg.engine.protocol import SamplingParams
from disagg.messages import GenerateParams
from disagg.router.router import _session_key as router_key
from disagg.router.types import RouteRequest
from disagg.session import session_key
from disagg.workers.tiered import _session_key as worker_key


@pytest.mark.parametrize("salt, sid, key", [("", "s1", "s1"), ("t0", "s1", "t0\x00s1"), ("t0", None, ""),
                                            ("t0", "", "")])
def test_session_key(salt, sid, key):
    assert session_key(salt, sid) == key


def test_one_session_id_under_two_salts_is_two_sessions():
    assert session_key("a", "s") != session_key("b", "s") != session_key("", "s")


@pytest.mark.parametrize("salt, sid", [("", "s1"), ("t0", "s1"), ("t0", None)])
def test_worker_and_router_key_sessions_alike(salt, sid):
    params = GenerateParams("r", [1, 2], SamplingParams(), session_id=sid, cache_salt=salt)
    req = RouteRequest("r", sid or "", [], 2, 64, cache_salt=salt)
    assert router_key(req) == session_key(salt, sid) == (worker_key(params) or "")
