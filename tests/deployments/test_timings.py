"""``deployments.timings``: the bounded stamp log and the ASGI middleware (no Ray, a real ASGI app)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.timings import CURRENT, RecentTimings, TimedASGI, stamp


def test_recent_timings_keeps_the_newest():
    log = RecentTimings(capacity=2)
    for rid in ("a", "b", "c"):
        log.put(rid, {"x": 1.0})
    log.put("b", {"x": 2.0})  # re-put: newest again
    log.put("d", {"x": 3.0})
    assert log.get(["a", "b", "c", "d"]) == {"b": {"x": 2.0}, "d": {"x": 3.0}}
    assert len(log) == 2
    with pytest.raises(ValueError):
        RecentTimings(capacity=0)


def test_stamp_outside_a_request_is_a_no_op():
    stamp("handler")
    assert CURRENT.get() is None


def _run(app, path="/v1/completions"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "path": path}, receive, send))
    return sent


async def _streaming_app(scope, receive, send):
    """A backend that names the request, stamps its handler, then streams two chunks."""
    stamps = CURRENT.get()
    if scope["path"] != "/health":
        stamps["request_id"] = "cmpl-1"
    stamp("handler")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"data: role\n\n", "more_body": True})
    stamp("chunk_in")
    stamp("chunk_in")  # once only
    await send({"type": "http.response.body", "body": b"data: token\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_middleware_stamps_arrival_and_the_first_body_after_the_first_token():
    log = RecentTimings()
    sent = _run(TimedASGI(_streaming_app, log))
    assert len(sent) == 4
    stamps = log.get(["cmpl-1"])["cmpl-1"]
    assert stamps["http_in"] <= stamps["handler"] <= stamps["chunk_in"] <= stamps["body_out"]
    assert set(stamps) == {"http_in", "handler", "chunk_in", "body_out", "request_id"}
    assert CURRENT.get() is None  # reset after the request


def test_requests_without_an_id_are_not_kept():
    log = RecentTimings()
    _run(TimedASGI(_streaming_app, log), path="/health")
    assert len(log) == 0
