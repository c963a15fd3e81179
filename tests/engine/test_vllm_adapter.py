"""The vLLM worker is an adapter of ``disagg.flow``: its hand-off, lookups and indices, on CPU.

vLLM itself is the system boundary here: ``_StandInEngine`` plays ``VLLMEngine``'s part of the
``FlowEngine`` interface (it records each request and its ``kv_transfer_params`` and answers
with fixed tokens). The tests against vLLM's real scheduler are ``tests/vllm`` (vllm extra).
"""

from __future__ import annotations

import asyncio
import inspect

from disagg.engine.protocol import SamplingParams, TokenOutput
from disagg.flow import FlowOptions
from disagg.messages import GenerateParams, PrefillHandle
from disagg.router.decider import DeciderConfig
from disagg.workers import vllm as vllm_worker
from disagg.workers.vllm import VLLMWorker
from kv_transfer.vllm.jobs import StateHandle


def _options(local_prefill_max_tokens: int) -> FlowOptions:
    return FlowOptions(DeciderConfig(local_prefill_max_tokens=local_prefill_max_tokens), prefill_retries=1)


class _StandInEngine:
    model_id = "m"
    block_size = 64
    eos_token_id = 0
    keeps_state = False

    def __init__(self):
        self.requests = []  # (EngineRequest, kv_transfer_params)

    async def generate(self, request, kv_transfer_params=None, on_finish=None):
        self.requests.append((request, kv_transfer_params))
        n = request.sampling.max_tokens
        for i in range(n):
            yield TokenOutput(request.request_id, [10 + i], i == n - 1, "length" if i == n - 1 else None,
                              len(request.prompt_token_ids), 0, "computed")

    async def resident_length(self, tokens, cache_salt=""):
        return 0

    async def resident_extent(self, tokens, cache_salt=""):
        return 0, 0

    def live_requests(self):
        return 0

    def stats(self):
        return {}


class _Lookup:
    """A presence-only store stand-in: the resumable length it was told."""

    def __init__(self, position):
        self.position, self.calls = position, 0

    def resumable_length(self, tokens, hasher, limit):
        self.calls += 1
        return type("Point", (), {"position": self.position, "slowest_tier": "host"})()

    def stats(self):
        return {}


def _params(n_prompt, max_tokens, resumed=0):
    return GenerateParams("r", list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          resumed_output_tokens=resumed)


def _run(worker, params, prefill_fn=None):
    async def go():
        return [c async for c in worker.generate(params, prefill_fn)]

    return asyncio.run(go())


def test_a_long_suffix_is_handed_off_with_the_producers_state_handle():
    engine = _StandInEngine()
    worker = VLLMWorker(engine, _Lookup(0), "d0", options=_options(100), producer_sizes=(2, 1))

    async def prefill(params):
        return PrefillHandle(300, 7, 0, "computed", "p0", "n0")

    chunks = _run(worker, _params(300, 3, resumed=5), prefill)
    assert [t for c in chunks for t in c.token_ids] == [7, 10, 11]  # the prefill's token first
    ((req, kv),) = engine.requests
    assert req.prompt_token_ids[-1] == 7 and len(req.prompt_token_ids) == 301
    assert req.first_output_index == 6  # resumed outputs + the prefill's token (disagg.flow NOTE 4)
    handle = StateHandle.from_params(kv)
    assert (handle.position, handle.tp_size, handle.dcp_size, handle.producer) == (300, 2, 1, "p0")
    assert worker.counters["remote_prefills"] == 1 and worker.flow.decisions == {"disagg": 1}


def test_the_stored_prefix_shortens_the_suffix_and_the_connector_loads_it():
    engine = _StandInEngine()
    lookup = _Lookup(256)
    worker = VLLMWorker(engine, lookup, "d0", options=_options(100))
    calls = []

    async def prefill(params):
        calls.append(params)
        raise AssertionError("a short suffix must not be sent to a prefill replica")

    _run(worker, _params(300, 2), prefill)
    ((req, kv),) = engine.requests
    assert not calls and kv is None and lookup.calls == 1  # the connector loads the prefix itself
    assert worker.counters["local_prefills"] == 1 and worker.flow.decisions == {"local_short_suffix": 1}


def test_a_failing_prefill_pool_is_retried_then_prefilled_locally():
    engine = _StandInEngine()
    worker = VLLMWorker(engine, None, "d0", options=_options(10))
    worker.flow.options.retry_backoff_s = 0.0
    attempts = []

    async def prefill(params):
        attempts.append(params)
        raise ConnectionError("prefill replica gone")

    chunks = _run(worker, _params(50, 2), prefill)
    assert len(attempts) == 2 and worker.counters["prefill_failures"] == 2
    assert [t for c in chunks for t in c.token_ids] == [10, 11] and engine.requests[0][1] is None


def test_the_vllm_worker_has_no_decode_flow_of_its_own():
    src = inspect.getsource(vllm_worker)
    assert "RequestFlow" in src and "async for out in self.engine.generate(req, {\"do_remote_decode\"" in src
    assert src.count("self.engine.generate(") == 1  # only the prefill's; decoding is disagg.flow's


def test_a_session_end_demotes_what_the_connector_saved_on_this_node_only():
    """``ConnectorState.demote_blocks`` (``disagg.flow`` NOTE 13) over a real host tier, in the
    lookup store's key space: this node's blocks are demoted (still held), another node's call
    demotes nothing."""
    from disagg.config import load_config
    from kv_transfer.tiers.host import HostTier

    tier = HostTier(8 << 20, pin_memory=False)
    try:
        lookup = vllm_worker.lookup_store(load_config({"model": {"name": "tiny"}}), [tier])
        hashes = [bytes([i]) * 16 for i in range(3)]
        keys = lookup.block_keys(hashes)
        for k in keys:
            tier.put_bytes(k, b"x" * 64)
        state = vllm_worker.ConnectorState(lookup, "m", 64, (1, 1), "n0")
        assert asyncio.run(state.demote_blocks("n1", hashes)) == 0
        assert tier.stats()["num_demoted"] == 0
        assert asyncio.run(state.demote_blocks("n0", hashes[::-1])) == 3
        assert tier.stats()["num_demoted"] == 3 and all(tier.contains(keys))
    finally:
        tier.close()
