"""A stream whose decode replicas are all lost waits for one (``disagg.stream_resume``).

The policy is tested as a pure function of time; the ingress's loop (``ServeBackend``) through
the real HTTP app, with the Serve deployment handle replaced by a scripted one: the handle is
the system boundary (Ray Serve), and a scripted one can be "down" for exactly as long as a
test needs. Real Serve replicas killed mid-stream: ``test_stream_resume_ray.py``.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from ray.exceptions import ActorDiedError

from deployments.ingress import ServeBackend
from disagg.api.app import create_app
from disagg.config import load_config
from disagg.messages import StreamChunk
from disagg.stream_resume import ResumeWait
from tests.helpers import serve_asgi


def test_backoff_doubles_up_to_its_cap_and_stops_at_the_deadline():
    wait = ResumeWait(timeout_s=5.0, started=100.0, first_delay_s=0.5, max_delay_s=2.0)
    assert [wait.next_delay(100.0) for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
    assert wait.next_delay(104.5) == 0.5, "never sleeps past the deadline"
    assert wait.next_delay(105.0) is None and wait.remaining(106.0) == 0.0


@pytest.mark.parametrize("bad", [{"timeout_s": 0}, {"first_delay_s": 0}, {"max_delay_s": 0.01}])
def test_resume_wait_refuses_bad_settings(bad):
    with pytest.raises(ValueError):
        ResumeWait(**({"timeout_s": 1.0, "started": 0.0} | bad))


class _Call:
    """One scripted replica call: output index i is token 100 + i (what a continuation must
    produce from its ``resumed_output_tokens``); ``die_after`` tokens, then the replica dies."""

    def __init__(self, params, mode: str, die_after: int | None = None):
        self.params, self.mode, self.die_after = params, mode, die_after
        self.cancelled = False

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        if self.mode == "dead":
            raise ActorDiedError()
        if self.mode == "queued":  # Serve holds the call while no replica is up
            await asyncio.sleep(3600)
        if self.params.ack:  # taken (as deployments.servers.DecodeServer.generate does)
            yield StreamChunk()
        if self.mode == "slow":  # a long prefill after taking the call
            await asyncio.sleep(1.5)
        start, n = self.params.resumed_output_tokens, self.params.sampling.max_tokens
        for i in range(n):
            if self.die_after is not None and i == self.die_after:
                raise ActorDiedError()
            await asyncio.sleep(0)
            yield StreamChunk(token_ids=[100 + start + i], finished=i == n - 1,
                              finish_reason="length" if i == n - 1 else None,
                              num_prompt_tokens=len(self.params.prompt_token_ids))

    def cancel(self):
        self.cancelled = True


class _Handle:
    """A decode deployment handle whose calls follow ``script`` (one mode per call, then "ok")."""

    def __init__(self, script: list[tuple[str, int | None]]):
        self.script, self.calls = list(script), []
        self.generate, self.stats = self, self._Stats()

    class _Stats:
        def remote(self, to=None):  # ``to``: the replica the ingress asks (one here)
            async def stats():
                return {}
            return stats()

    def options(self, stream: bool):
        return self

    def remote(self, params):
        mode, die_after = self.script.pop(0) if self.script else ("ok", None)
        self.calls.append(_Call(params, mode, die_after))
        return self.calls[-1]


def _serve(script, **deployment):
    cfg = load_config({"model": {"name": "tiny"}, "deployment": deployment})
    handle = _Handle(script)
    return handle, serve_asgi(create_app(ServeBackend(cfg, handle), cfg.http))


def _stream(url: str, n: int) -> tuple[list[int], dict | None]:
    body = {"model": "disagg-tiny", "prompt": [5, 6, 7], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    tokens, error = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                error = obj.get("error", error)
                for c in obj.get("choices", []):
                    tokens.extend(c.get("token_ids") or [])
    return tokens, error


def _metric(url: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M).group(1))


def test_an_outage_of_every_replica_is_waited_out_and_the_stream_completes_exactly():
    """Lost after 3 tokens; the next 3 calls find no live replica (backoff between them), then
    one answers: every token arrives once, in order, with no error."""
    handle, server = _serve([("ok", 3), ("dead", None), ("dead", None), ("dead", None)],
                            stream_resume_timeout_s=30.0, max_stream_resumes=1)
    with server as url:
        tokens, error = _stream(url, 10)
        assert error is None and tokens == [100 + i for i in range(10)]
        assert _metric(url, "disagg_resumed_streams") == 1, "one loss, however many tries it took"
        assert _metric(url, "disagg_stream_resume_timeouts") == 0
    last = handle.calls[-1].params
    assert len(handle.calls) == 5 and last.resumed_output_tokens == 3 and last.sampling.max_tokens == 7
    assert last.prompt_token_ids == [5, 6, 7, 100, 101, 102], "the continuation's prompt is prompt + sent tokens"


@pytest.mark.parametrize("down", ["dead", "queued"])
def test_an_outage_past_the_deadline_is_an_explicit_503_counted_in_metrics(down):
    """No replica comes back (calls fail at once, or wait in Serve's queue): the stream ends with a
    ``stream_resume_timeout`` error event after the tokens already sent, never a silent short answer."""
    handle, server = _serve([("ok", 2)] + [(down, None)] * 100, stream_resume_timeout_s=0.8)
    with server as url:
        tokens, error = _stream(url, 10)
        assert tokens == [100, 101]
        assert error is not None and error["code"] == "stream_resume_timeout", error
        assert "deployment.stream_resume_timeout_s" in error["message"]
        assert _metric(url, "disagg_stream_resume_timeouts") == 1
        assert all(c.cancelled for c in handle.calls[1:] if c.mode == "queued"), "a late call is cancelled"


def test_a_continuation_taken_in_time_may_take_longer_than_the_timeout_to_compute():
    """The outage ends when a replica acknowledges the continuation; its prefill is not an outage."""
    handle, server = _serve([("ok", 2), ("slow", None)], stream_resume_timeout_s=0.5)
    with server as url:
        tokens, error = _stream(url, 6)
    assert error is None and tokens == [100 + i for i in range(6)]
    assert handle.calls[1].params.ack and not handle.calls[0].params.ack, "only continuations ask for one"


def test_losses_after_progress_count_against_max_stream_resumes():
    """Each continuation streams a token, then its replica dies: the second loss is one too many."""
    handle, server = _serve([("ok", 2), ("ok", 1), ("ok", 1)], max_stream_resumes=1, stream_resume_timeout_s=30.0)
    with server as url:
        tokens, error = _stream(url, 10)
    assert tokens == [100, 101, 102] and error is not None and error["code"] == "backend_unavailable"
    assert len(handle.calls) == 2
