"""The reference engine's state through the tiers: engine -> host -> disk -> host -> engine, exactly."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.engine import EngineOptions, ReferenceEngine
from disagg.engine.reference.model import K3ForCausalLM
from kv_transfer.keys import BlockHasher, KeyExtras, ObjectKey
from kv_transfer.store import StateStore
from kv_transfer.tiers.disk import DiskTier
from kv_transfer.tiers.host import HostTier


@pytest.fixture(scope="module")
def model():
    return K3ForCausalLM.random_init(load_preset("tiny"), seed=0, dtype=torch.float32).eval()


def _engine(model) -> ReferenceEngine:
    return ReferenceEngine(model, "tiny-tiers", EngineOptions(block_size=64, max_num_batched_tokens=256,
                                                              cache_budget_bytes=32 << 20, resident_sessions=False,
                                                              capture_logits=True))


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 260, (n,), generator=g).tolist()


def test_state_survives_host_disk_host_round_trip_exactly(model, tmp_path):
    turn1 = _prompt(230, 1)
    src = _engine(model)
    out1, _ = src.generate(EngineRequest("t1", turn1, SamplingParams(max_tokens=9, ignore_eos=True),
                                         keep_state=True))
    computed = src.computed_tokens("t1")
    state = src.export_state("t1")
    assert state.position == 238 and state.tail is not None  # unaligned turn end: tail + KDA checkpoint

    hasher = BlockHasher(64, KeyExtras(src.model_id))
    block_bytes = src.layout.mla_block_bytes()
    host = HostTier(16 * block_bytes, slab_bytes=16 * block_bytes)
    disk = DiskTier(str(tmp_path), 64 << 20)
    store = StateStore([host, disk], src.layout)
    try:
        put = store.put_state(computed, state, hasher)
        assert put.num_stored == 3 + 1 + 1  # three blocks, the tail, the KDA checkpoint
        # push everything of this session out of the host tier with other sessions' state
        other = _engine(model)
        for i in range(4):
            p = _prompt(200, 100 + i)
            other.generate(EngineRequest(f"o{i}", p, SamplingParams(max_tokens=1), keep_state=True))
            store.put_state(p, other.export_state(f"o{i}"), hasher)
            other.release(f"o{i}", keep_resident=False)
        disk.sync()
        first_block = str(ObjectKey("mla", hasher.block_hashes(computed)[0]))
        assert host.contains([first_block]) == [False] and disk.contains([first_block]) == [True]

        turn2 = computed + [out1[-1]] + _prompt(50, 2)
        point = store.resumable_length(turn2, hasher, max_position=len(turn2) - 1)
        assert point.position == state.position and point.slowest_tier == "disk"
        promoted = store.stats()["num_promoted"]
        loaded = store.load_state(turn2, point.position, hasher)
        assert loaded is not None
        assert store.stats()["num_promoted"] - promoted == 5  # every piece came back up to the host tier

        ref = _engine(model)
        ref_tokens, _ = ref.generate(EngineRequest("full", turn2, SamplingParams(max_tokens=8, ignore_eos=True)))
        dst = _engine(model)
        tokens, last = dst.generate(EngineRequest("resumed", turn2, SamplingParams(max_tokens=8, ignore_eos=True),
                                                  resume=loaded, cached_source="disk"))
        assert last.num_cached_tokens == state.position and last.cached_source == "disk"
        assert tokens == ref_tokens
        err = (dst.last_logits["resumed"] - ref.last_logits["full"]).abs().max() / ref.last_logits["full"].abs().max()
        assert err < 1e-5
    finally:
        disk.close()
        host.close()
