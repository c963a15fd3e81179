"""Delta loads (``disagg.flow`` NOTE 11, reference engine NOTE 8): a hand-off to the decode replica
that decoded the session's last turn moves only the new turn's blocks.

Real engines (tiny CPU model) and a real host tier shared by a decode and a prefill worker of one
node; no Ray cluster. Turn 1 is prefilled and decoded on the decode worker (its state stays
resident on that engine); turn 2's long suffix goes to the prefill worker, whose hand-off the
decode worker opens. Outputs are compared token for token with the reference engine's.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from disagg.config import load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.engine import ReferenceEngine
from disagg.flow import FlowOptions
from disagg.messages import GenerateParams
from disagg.router.decider import DeciderConfig
from disagg.workers.tiered import StatefulWorker
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def node(request):
    """(decode worker, prefill worker, reference engine) of one node: one host tier; the engines on
    the CPU, or on a GPU (loads then go straight to the device)."""
    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny", "device": request.param},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1}})
    engine = build_reference_engine(cfg)
    store = StateStore([HostTier(64 << 20, pin_memory=False)], engine.layout, write_behind=False)

    def copy():
        return AsyncEngine(ReferenceEngine(engine.model, engine.model_id, engine.options))

    # the decode worker prefills short suffixes itself (turn 1) and sends long ones to the pool (turn 2)
    decode = StatefulWorker(copy(), store, "decode", "n",
                            options=FlowOptions(DeciderConfig(local_prefill_max_tokens=200, local_harm_weight=0)))
    prefill = StatefulWorker(copy(), store, "prefill", "n")
    try:
        yield decode, prefill, ReferenceEngine(engine.model, engine.model_id, engine.options)
    finally:
        decode.engine.shutdown()
        prefill.engine.shutdown()
        torch.set_num_threads(threads)


def _run(worker, params, prefill_fn=None, also=()):
    async def go():
        out, chunks = [], []
        async for chunk in worker.generate(params, prefill_fn):
            out.extend(chunk.token_ids)
            chunks.append(chunk)
        for w in (worker, *also):
            await w.drain()
        return out, chunks

    return asyncio.run(go())


def _evict_all(engine) -> None:
    while engine._residents:  # the device tier's LRU, emptied
        engine._evict_resident()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("evicted", [False, True])
def test_a_hand_off_moves_only_the_blocks_the_decode_engine_lacks(node, evicted):
    """Turn 2's hand-off skips the rows of turn 1 that the decode engine holds resident: fewer
    bytes than the whole state, the same tokens. When the resident session is evicted between
    the plan and the admission, the engine computes the skipped rows instead: still exact."""
    decode, prefill, reference = node
    bs = decode.engine.block_size
    rng = random.Random(11)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    turn1 = [rng.randrange(4, 260) for _ in range(150)]
    out1, _ = _run(decode, GenerateParams("t1", turn1, sampling, session_id="s"))
    turn2 = turn1 + out1 + [rng.randrange(4, 260) for _ in range(300)]  # 300 > 200: the pool prefills

    async def prefill_fn(params):
        handle = await prefill.prefill(params)
        if evicted:  # the decode engine's device tier is emptied while the prefill ran
            await decode.engine.call(_evict_all, decode.engine.engine)
        return handle

    out2, chunks = _run(decode, GenerateParams("t2", turn2, sampling, session_id="s"), prefill_fn, (prefill,))
    want, _ = reference.generate(EngineRequest("ref", turn2, sampling))
    assert out2 == want
    assert decode.counters["remote_prefills"] == 1
    full, tail = divmod(len(turn2), bs)  # the hand-off: full blocks, a tail and the KDA state
    aligned = prefill.store.load_state(turn2, full * bs, decode.hasher, decode.engine.layout, contiguous=True)
    block_bytes = aligned.mla_rows.nbytes // full
    kda_bytes = sum(k.conv.nbytes + k.recurrent.nbytes for k in aligned.kda)
    resident = (len(turn1) + len(out1) - 1) // bs  # turn 1's computed rows, in full blocks
    assert resident >= 2
    skipped = full - resident
    assert chunks[-1].transfer_bytes == skipped * block_bytes + tail * block_bytes // bs + kda_bytes
    assert decode.engine.engine.counters["delta_base_misses"] == (1 if evicted else 0)


@pytest.mark.timeout(300)
def test_a_delta_state_is_checked_at_admission(node):
    """A delta state's blocks must start at its first block; one claiming more than its prompt
    is refused with a clear error."""
    decode, prefill, reference = node
    engine = decode.engine.engine
    rng = random.Random(12)
    prompt = [rng.randrange(4, 260) for _ in range(300)]
    prefill.store.put_state(prompt[:256], _export(reference, prompt[:257], 256), decode.hasher)
    bs = engine.block_size
    state = prefill.store.load_state(prompt, 256, decode.hasher, engine.layout, first_block=2)
    assert state.first_block == 2 and len(state.mla_blocks) == 256 // bs - 2
    engine._check_resume(state, prompt)  # well formed
    state.mla_blocks = state.mla_blocks[1:]
    with pytest.raises(ValueError, match="from block 2 carries"):
        engine._check_resume(state, prompt)


def _export(engine: ReferenceEngine, tokens: list[int], position: int):
    """The state of ``tokens[:position]`` computed by ``engine``."""
    rid = "export"
    engine.add_request(EngineRequest(rid, tokens, SamplingParams(max_tokens=1), keep_state=True))
    while engine.has_work():
        engine.step()
    state = engine.export_state(rid, position)
    engine.release(rid)
    return state
