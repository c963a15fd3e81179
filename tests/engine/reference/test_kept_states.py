"""Kept KDA states live in the MLA pool (engine NOTE 10, paged_cache NOTE 4): the cache budget
bounds what resident sessions keep, a state survives its round trip through pages bit for bit,
and room runs out gracefully (points dropped, a held request's end state kept aside)."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.protocol import EngineRequest
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.engine import _Kept
from disagg.engine.reference.model import K3ForCausalLM
from disagg.engine.reference.paged_cache import PagedStateCache, size_cache
from tests.engine.reference.test_engine import BS, greedy, make_engine, prompt


@pytest.fixture(scope="module")
def model():
    return K3ForCausalLM.random_init(load_preset("tiny"), seed=0, dtype=torch.float32).eval()


def pages_accounted(eng) -> None:
    """Every page is free, in a resident's table, in a live request's table, or holds a kept state."""
    kept = [c for r in eng._residents.values() for c in r.checkpoints.values()]
    kept += [c for r in list(eng._running) + list(eng._held.values()) for c in r.checkpoints.values()]
    assert sum(len(c.pages) for c in kept) == eng.stats()["checkpoint_blocks"]
    tables = sum(len(r.block_table) for r in eng._residents.values())
    tables += sum(len(r.block_table) for r in list(eng._running) + list(eng._held.values()))
    assert eng.cache.blocks.num_free + tables + eng.stats()["checkpoint_blocks"] == eng.geometry.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_round_trips_through_pages_bit_for_bit_and_leaves_zeros(dtype):
    """Recurrent state (fp32 under a bf16 cache) and conv state written as page bytes read back
    identical, NaN bit patterns included; pages given back are zeroed, since masked rows are read
    (0 x NaN is NaN)."""
    m = K3ForCausalLM.random_init(load_preset("tiny"), seed=0, dtype=dtype)
    layout = m.state_layout("t", BS, dtype)
    geo = size_cache(layout, 16 << 20, 2)
    cache = PagedStateCache(layout, geo)
    assert geo.checkpoint_pages * geo.block_bytes >= geo.slot_bytes > 0
    g = torch.Generator().manual_seed(0)
    for t in (cache.conv_all, cache.rec_all):  # random bits, NaN and inf patterns among them
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    pages = cache.blocks.allocate(geo.checkpoint_pages)
    cache.save_state(cache.conv_all[:, 1], cache.rec_all[:, 1], pages)
    conv, rec = cache.read_state(pages)
    assert torch.equal(conv.view(torch.uint8), cache.conv_all[:, 1].contiguous().view(torch.uint8))
    assert torch.equal(rec.view(torch.uint8), cache.rec_all[:, 1].contiguous().view(torch.uint8))
    cache.load_state(pages, 0)
    assert torch.equal(cache.rec_all[:, 0].view(torch.uint8), cache.rec_all[:, 1].view(torch.uint8))
    assert torch.equal(cache.conv_all[:, 0].view(torch.uint8), cache.conv_all[:, 1].view(torch.uint8))
    cache.drop_state(pages)
    assert cache.blocks.num_free == geo.num_blocks
    assert not cache.mla_all[:, pages].view(torch.uint8).any()


def test_the_budget_bounds_what_residents_keep(model):
    """Sessions fill the pool with residents, each keeping two states (its prompt's end and its
    turn's end). The states take pages, so fewer sessions stay than their rows alone would leave
    room for; none is kept outside the pool, and the newest session still resumes on the device,
    exactly."""
    eng = make_engine(model, cache_budget_bytes=4 << 20, max_num_seqs=2)
    k = eng.geometry.checkpoint_pages
    assert k > 1
    for i in range(8):
        eng.generate(EngineRequest(f"s{i}", prompt(5 * BS + 9, seed=100 + i), greedy(3)))
        pages_accounted(eng)
    kept = [c for r in eng._residents.values() for c in r.checkpoints.values()]
    assert kept and all(c.tensors is None and len(c.pages) == k for c in kept)
    rows = max(len(r.block_table) for r in eng._residents.values())
    assert len(eng._residents) < eng.geometry.num_blocks // rows  # the states took room rows alone would leave
    assert eng.counters["resident_evictions"] > 0
    assert eng.counters["checkpoints_unbudgeted"] == 0
    # the last session's next turn resumes from a state read back from its pages
    p = prompt(5 * BS + 9, seed=107)
    first, _ = make_engine(model, resident_sessions=False).generate(EngineRequest("r0", p, greedy(3)))
    turn2 = p + first + prompt(40, seed=3)
    got, last = eng.generate(EngineRequest("t2", turn2, greedy(5)))
    assert last.cached_source == "device" and last.num_cached_tokens > 0
    want, _ = make_engine(model, resident_sessions=False).generate(EngineRequest("ref", turn2, greedy(5)))
    assert got == want
    pages_accounted(eng)


def test_a_held_end_state_without_room_is_kept_aside_until_release(model):
    """A keep_state request that fills the pool keeps its end state in tensors of its own (it
    must export it) and exports it exactly; released where its own rows leave no room for the
    state, it is not made resident and every page is free."""
    g = make_engine(model).geometry
    k = g.checkpoint_pages
    blocks = 6  # the request's rows take 5 pages, so its end state cannot have k more
    eng = make_engine(model, cache_budget_bytes=g.slot_bytes * 2 + g.block_bytes * blocks, max_num_seqs=2)
    assert k > blocks - 5
    p = prompt(5 * BS - 20, seed=60)
    eng.generate(EngineRequest("held", p, greedy(3), keep_state=True))
    assert eng.counters["checkpoints_unbudgeted"] == 1
    assert eng.counters["checkpoints_dropped"] >= 1  # its optional points found no room
    held = eng._held["held"]
    assert [c.tensors is not None for c in held.checkpoints.values()] == [True]
    pages_accounted(eng)
    position = eng.checkpoint_positions("held")[-1]
    state = eng.export_state("held", position)
    ref = make_engine(model, resident_sessions=False)
    ref.generate(EngineRequest("held", p, greedy(3), keep_state=True))
    want = ref.export_state("held", position)
    assert torch.equal(state.kda[0].recurrent, want.kda[0].recurrent)
    assert torch.equal(state.kda[0].conv, want.kda[0].conv)
    eng.release("held")  # its rows leave too few pages for its state: not resident, nothing kept aside
    assert not eng._residents and eng.cache.blocks.num_free == eng.geometry.num_blocks
    pages_accounted(eng)


def test_a_released_state_moves_into_pages_when_there_is_room(model):
    """The kept-aside end state of a held request becomes a resident's pages when the pool has
    room by then, and the session's next turn resumes from it exactly."""
    g = make_engine(model).geometry
    eng = make_engine(model, cache_budget_bytes=g.slot_bytes * 2 + g.block_bytes * (5 + g.checkpoint_pages),
                      max_num_seqs=2, checkpoint_interval=0)
    other = prompt(3 * BS, seed=61)
    eng.add_request(EngineRequest("other", other, greedy(40)))  # holds pages while "held" finishes
    p = prompt(3 * BS - 10, seed=62)
    eng.add_request(EngineRequest("held", p, greedy(2), keep_state=True))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert eng.counters["checkpoints_unbudgeted"] == 1
    eng.release("held")
    (res,) = [r for r in eng._residents.values() if r.tokens == (p + out["held"])[: len(r.tokens)]]
    assert res.checkpoints and all(c.tensors is None and c.pages for c in res.checkpoints.values())
    pages_accounted(eng)
    turn2 = p + out["held"] + prompt(30, seed=4)
    got, last = eng.generate(EngineRequest("t2", turn2, greedy(4)))
    assert last.cached_source == "device"
    want, _ = make_engine(model, resident_sessions=False).generate(EngineRequest("ref", turn2, greedy(4)))
    assert got == want


def test_block_0_never_holds_a_state(model):
    """Decode batches pad their block tables with block 0 and read it masked (0 x NaN is NaN),
    so a state's pages never include it, even when it is the next free block."""
    eng = make_engine(model, cache_budget_bytes=4 << 20, max_num_seqs=2)
    k, blocks = eng.geometry.checkpoint_pages, eng.cache.blocks
    taken = blocks.allocate(blocks.num_free)
    blocks.free([b for b in taken if b != 0][:k])
    blocks.free([0])  # the next block handed out
    pages = eng._pages()
    assert pages is not None and len(pages) == k and 0 not in pages and blocks.num_free == 1
    assert eng.stats()["checkpoint_blocks"] == k
    eng._drop(_Kept(pages))
    (other,) = blocks.allocate(1)  # the last page given back: k free now, block 0 among them
    assert other != 0 and blocks.num_free == k
    assert eng._pages() is None and blocks.num_free == k  # no room without block 0


def test_the_kept_state_figures_reach_the_metrics(model):
    """/metrics sums the engines' kept-state figures by role (``disagg_engine_kept_states``): the
    pages held, and the points dropped and end states kept aside for want of room; a replica whose
    engine reports none (vLLM's) adds nothing."""
    from disagg.api.metrics import ServingMetrics, merge_replica_stats

    g = make_engine(model).geometry
    eng = make_engine(model, cache_budget_bytes=g.slot_bytes * 2 + g.block_bytes * 6, max_num_seqs=2)
    eng.generate(EngineRequest("held", prompt(5 * BS - 20, seed=60), greedy(3), keep_state=True))
    roomy = make_engine(model)
    roomy.generate(EngineRequest("a", prompt(3 * BS + 5, seed=61), greedy(2)))
    st, st2 = eng.stats(), roomy.stats()
    assert st["checkpoints_unbudgeted"] == 1 and st["checkpoints_dropped"] >= 1 and st2["checkpoint_blocks"] > 0
    merged = merge_replica_stats([{"role": "prefill", "engine": st}, {"role": "decode", "engine": st2},
                                  {"role": "decode", "engine": st2}, {"role": "decode", "engine": {"running": 1}}])
    assert merged["kept_states"] == {
        "prefill": {"pages": st["checkpoint_blocks"], "dropped": st["checkpoints_dropped"], "unbudgeted": 1},
        "decode": {"pages": 2 * st2["checkpoint_blocks"], "dropped": 0, "unbudgeted": 0}}
    metrics = ServingMetrics()
    metrics.observe_stats(merged)
    text = metrics.render()[0].decode()
    for line in ('disagg_engine_kept_states{figure="unbudgeted",role="prefill"} 1.0',
                 f'disagg_engine_kept_states{{figure="pages",role="decode"}} {2.0 * st2["checkpoint_blocks"]}'):
        assert line in text, line
    assert "kept_states" not in merge_replica_stats([{"role": "decode", "engine": {"running": 1}}])
