"""The vLLM backend's request flow (VLLMEngine + VLLMWorker), prefill -> hand-off -> decode.

``AsyncLLM`` needs a GPU, so it is replaced at that boundary by ``HarnessLLM``:
vLLM's real Scheduler and the K3 state connector, stepped by the harness's
deterministic forward (see k3_harness). Everything above it is the backend's
own code: sampling-param mapping, token streaming, kv_transfer_params, the
worker's conditional disaggregation and the P/D hand-off.
"""

from __future__ import annotations

import asyncio

import k3_harness as H
import pytest

pytestmark = pytest.mark.vllm


class HarnessLLM:
    """Stands in for ``vllm.v1.engine.async_llm.AsyncLLM`` (generate / abort / errored).

    Like vLLM's engine core, a background task keeps stepping while anything is
    pending (requests, saves), independently of the streams reading outputs.
    """

    errored = False

    def __init__(self, engine: H.Engine):
        self.e = engine
        self._task: asyncio.Task | None = None

    def _busy(self) -> bool:
        e = self.e
        return e.sched.has_unfinished_requests() or e.connector.has_pending_push_work() \
            or e.worker._worker.has_pending_saves()

    async def _loop(self) -> None:
        while True:
            if self._busy():
                self.e.step()
            await asyncio.sleep(0.001)

    async def generate(self, prompt: dict, sp, request_id: str):
        from vllm.outputs import CompletionOutput, RequestOutput

        if self._task is None or self._task.done() or self._task.get_loop() is not asyncio.get_running_loop():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        kvp = (sp.extra_args or {}).get("kv_transfer_params")
        tokens = list(prompt["prompt_token_ids"])
        self.e.add(request_id, tokens, max_tokens=sp.max_tokens, kv_params=kvp)
        sent = 0
        deadline = asyncio.get_running_loop().time() + 60
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.001)
            new = self.e.outputs[request_id][sent:]
            done = self.e.finished.get(request_id)
            if new or done:
                sent += len(new)
                loads = [j for s in self.e.step_log for j in s["loads"] if j.req_id == request_id]
                comp = CompletionOutput(0, "", new, None, None, finish_reason=done.reason if done else None)
                yield RequestOutput(request_id, None, tokens, None, [comp], done is not None,
                                    num_cached_tokens=loads[0].position if loads else 0,
                                    kv_transfer_params=done.kv_transfer_params if done else None)
            if done:
                return
        raise AssertionError("request did not finish")

    async def abort(self, request_id: str) -> None:
        return None


def _app(**over):
    from disagg.config import load_config

    cfg = {"model": {"name": str(H.TINY), "served_name": "tiny-k3", "dtype": "bfloat16"},
           "engine": {"backend": "vllm", "block_size": 128, "vllm": {}},
           "router": {"local_prefill_max_tokens": 256}}
    cfg.update(over)
    return load_config(cfg)


def _backend(app, role: str, harness_engine: H.Engine):
    from disagg.engine.vllm.engine import VLLMEngine

    eng = VLLMEngine(app, role, host_socket=None, start=False, engine_id=f"{role}-0")
    eng.llm = HarnessLLM(harness_engine)
    return eng


def _params(rid: str, prompt: list[int], n: int):
    from disagg.engine.protocol import SamplingParams
    from disagg.messages import GenerateParams

    return GenerateParams(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))


async def _collect(worker, params, prefill_fn=None):
    chunks = [c async for c in worker.generate(params, prefill_fn)]
    assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == params.sampling.max_tokens
    return [t for c in chunks for t in c.token_ids], chunks


def test_disaggregated_request_through_the_backend_equals_a_local_one():
    from disagg.flow import FlowOptions
    from disagg.router.decider import DeciderConfig
    from disagg.workers.vllm import VLLMWorker

    assert H.MODEL_ID == "tiny-k3|bfloat16"  # the backend's key space for this app
    name, tier = H.make_tier()
    app = _app()
    prefill = VLLMWorker(_backend(app, "prefill", H.Engine(H.vllm_config(tier=name, engine_id="prefill-0"))),
                         replica_id="p0")
    decode = VLLMWorker(_backend(app, "decode", H.Engine(H.vllm_config(tier=name, engine_id="decode-0"))),
                        replica_id="d0",
                        options=FlowOptions(DeciderConfig(local_prefill_max_tokens=256), prefill_retries=1))
    prompt = H.prompt(700, seed=21)

    async def remote(params):
        return await prefill.prefill(params)

    tokens, chunks = asyncio.run(_collect(decode, _params("r1", prompt, 4), remote))
    assert decode.counters["remote_prefills"] == 1 and prefill.counters["prefills"] == 1
    assert chunks[0].replica_id == "d0" and len(chunks[0].token_ids) == 1  # the prefill's first token
    assert tokens == H.baseline(prompt, 4)
    # the decode engine resumed at the prompt end: it computed token 700 and the decodes only
    d_engine = decode.engine.llm.e
    (load,) = [j for s in d_engine.step_log for j in s["loads"]]
    assert load.position == 700
    assert sum(s["scheduled"].get("r1/decode", 0) for s in d_engine.step_log) == 3


def test_short_suffix_prefills_locally_and_resumes_from_the_nodes_tier():
    from disagg.flow import FlowOptions
    from disagg.router.decider import DeciderConfig
    from disagg.workers.vllm import VLLMWorker, lookup_store

    name, tier = H.make_tier()
    app = _app()
    first = H.prompt(600, seed=22)
    eng = H.Engine(H.vllm_config(tier=name, engine_id="decode-0"))
    decode = VLLMWorker(_backend(app, "decode", eng), lookup=lookup_store(app, [tier]),
                        options=FlowOptions(DeciderConfig(local_prefill_max_tokens=256), prefill_retries=1))
    out1, _ = asyncio.run(_collect(decode, _params("t1", first, 3)))
    eng.run()  # the turn-end save lands before the next turn arrives
    calls = []

    async def remote(params):  # must not be called: the suffix after the stored turn end is short
        calls.append(params)
        raise AssertionError("remote prefill")

    second = first + out1[:2] + H.prompt(40, seed=23)
    out2, chunks = asyncio.run(_collect(decode, _params("t2", second, 3), remote))
    assert not calls and decode.counters["local_prefills"] == 2
    assert chunks[-1].num_cached_tokens == 602  # the first turn's end, loaded by the connector
    assert out2 == H.baseline(second, 3)


def test_a_session_end_turn_saves_nothing_and_demotes_what_earlier_turns_saved():
    """A session's last turn (``session_end``, flow NOTE 13) over vLLM: the request tells the
    connector to save none of it (scheduler side NOTE 4), so the node's tier gains no object, and
    the blocks the session's earlier turn saved are demoted there; its output is the reference's.
    A turn without the flag saves (the control)."""
    import uuid

    from kv_transfer.tiers.host import HostTier
    from kv_transfer.vllm.stores import register_local_tier

    name = f"host-{uuid.uuid4().hex[:8]}"
    with HostTier(64 << 20) as tier:  # a host tier that orders its evictions (the harness's dict does not)
        register_local_tier(name, tier)
        _end_a_session(name, tier)


def _end_a_session(name: str, tier) -> None:
    from dataclasses import replace

    from disagg.flow import FlowOptions
    from disagg.router.decider import DeciderConfig
    from disagg.workers.vllm import VLLMWorker, lookup_store

    app = _app()
    first = H.prompt(600, seed=31)
    eng = H.Engine(H.vllm_config(tier=name, engine_id="decode-0"))
    decode = VLLMWorker(_backend(app, "decode", eng), lookup=lookup_store(app, [tier]),
                        options=FlowOptions(DeciderConfig(local_prefill_max_tokens=256), prefill_retries=1))
    out1, _ = asyncio.run(_collect(decode, replace(_params("t1", first, 3), session_id="s")))
    eng.run()
    sched = eng.connector._sched
    saved = set(tier.keys())
    assert saved and sched.counters["saves_finish"] == 1 and sched.counters["saves_declined"] == 0

    second = first + out1[:2] + H.prompt(300, seed=32)
    last = replace(_params("t2", second, 3), session_id="s", session_end=True)

    async def last_turn():
        got = await _collect(decode, last)
        await decode.drain()  # the end's demote runs in the background
        return got

    out2, chunks = asyncio.run(last_turn())
    eng.run()
    assert out2 == H.baseline(second, 3)
    assert chunks[-1].num_cached_tokens == 602  # resumed from the first turn's end
    assert set(tier.keys()) == saved  # the last turn stored nothing
    assert sched.counters["saves_finish"] == 1 and sched.counters["saves_declined"] >= 1
    assert decode.flow.counters["sessions_ended"] == 1
    assert decode.flow.counters["session_end_demoted"] == 4  # the first turn's 4 full blocks, all private
