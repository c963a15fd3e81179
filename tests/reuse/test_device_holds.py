"""The node's host tier as its devices' victim cache (``transfer.host.victim``, in process,
aggregated, tiny model on CPU): a resident session's keys are held in the host tier; what the
tier let go of is written back when the engine evicts the session, so its next turn resumes from
the host tier token-exact, where write-through alone recomputes it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.engine import ReferenceEngine
from tests.reuse.test_worker_reuse import BS, backend, ids, send, threads  # noqa: F401 - threads is a fixture


def victim_backend(victim: bool):
    # 10 MiB of engine cache: 39 pages of the tiny model. A resident session of 11 blocks keeps its KDA
    # states beside them, 6 pages each (engine NOTE 10): a 20-block prompt evicts it
    return backend(deployment={"mode": "aggregated"}, engine={"cache_budget_mb": 10},
                   transfer={"host": {"capacity_mb": 256, "pin_memory": False, "victim": victim}})


def uninterrupted(prompt: list[int]):
    """(tokens, last chunk) of ``prompt`` on a fresh worker that never stored anything."""
    ref = backend(deployment={"mode": "aggregated"})
    try:
        return asyncio.run(send(ref, "r", prompt, "x"))
    finally:
        ref.shutdown()


def _block_keys(b, tokens: list[int]) -> list[str]:
    hasher = b.decode.hasher
    return b.store.block_keys(hasher.block_hashes(tokens))


@pytest.mark.parametrize("victim", [True, False])
def test_an_evicted_session_is_written_back_where_the_host_tier_let_it_go(threads, victim):  # noqa: F811
    b = victim_backend(victim)
    host = b.store.tiers[0]
    first = ids(10 * BS + 20, 1)
    try:
        async def go():
            out1, _ = await send(b, "a1", first, "A")
            ended = first + out1[:-1]  # the turn end: the last token sampled is not computed yet
            blocks = _block_keys(b, ended)
            assert len(blocks) == 10 and all(host.contains(blocks))
            if victim:  # every block and the checkpoints of the resident session are held
                assert host.num_held() >= len(blocks) + 3
                assert b.decode.holds.stats()["held_keys"] == host.num_held()
            for key in blocks:  # the host tier let them go (held keys go first when it is full)
                assert host.delete(key)
            await send(b, "b1", ids(20 * BS, 2), "B")  # needs 20 of the engine's 27 blocks: A is evicted
            assert b.decode.engine.stats()["resident_evictions"] >= 1
            if victim:
                holds = b.decode.holds.stats()
                assert holds["evicted"] >= 1 and holds["written_back"] >= len(blocks)
                assert all(host.contains(blocks)), "the evicted session's blocks are back in the host tier"
            else:
                assert not any(host.contains(blocks))
            second = first + out1 + ids(30, 3)
            out2, last2 = await send(b, "a2", second, "A")
            return ended, second, out2, last2

        ended, second, out2, last2 = asyncio.run(go())
    finally:
        b.shutdown()
    if victim:
        assert last2.num_cached_tokens == len(ended) and last2.cached_source == "host"
    else:
        assert last2.num_cached_tokens < 10 * BS, "write-through alone lost the session's blocks"
    out_ref, last_ref = uninterrupted(second)
    assert last_ref.num_cached_tokens == 0 and out2 == out_ref


def test_the_engine_tells_of_residents_kept_taken_and_evicted_with_their_state(threads):  # noqa: F811
    """``ReferenceEngine`` NOTE 9: the hook hears each change; an evicted session's export is its
    state at a checkpoint, equal to what ``export_state`` gave before its release, from any block."""
    from disagg.config import load_config
    from disagg.engine.factory import build_reference_engine

    engine: ReferenceEngine = build_reference_engine(load_config({"model": {"name": "tiny"},
                                                                  "engine": {"cache_budget_mb": 9}}))
    seen, exported = [], {}

    def hook(change):
        seen.append((change.kind, change.resident_id, len(change.tokens)))
        if change.kind == "evicted":
            exported["state"] = change.export(change.checkpoints[-1], 2)
            try:
                change.export(1, 0)  # no checkpoint there
            except ValueError as exc:
                exported["refused"] = str(exc)

    engine.on_resident = hook
    prompt = ids(6 * BS + 5, 7)
    engine.generate(EngineRequest("a", prompt, SamplingParams(max_tokens=2, ignore_eos=True), keep_state=True))
    before = engine.export_state("a", None, 2)
    engine.release("a")
    assert seen == [("kept", 0, 6 * BS + 6)]
    resident = engine.export_resident(0, 6 * BS + 6, 2)  # a node mate's recall (holds NOTE 5)
    assert resident.position == before.position and resident.first_block == 2
    for mine, theirs in zip(resident.mla_blocks, before.mla_blocks, strict=True):
        assert torch.equal(mine.rows, theirs.rows)
    with pytest.raises(ValueError, match="no KDA checkpoint at 7"):
        engine.export_resident(0, 7)
    follow = prompt + ids(40, 8)  # extends the resident: adopts it
    engine.generate(EngineRequest("b", follow, SamplingParams(max_tokens=2, ignore_eos=True), keep_state=True))
    engine.release("b")
    assert seen[1] == ("taken", 0, 6 * BS + 6) and seen[2][0] == "kept"
    assert engine.export_resident(0, 6 * BS + 6) is None, "taken back: no longer resident"
    engine.generate(EngineRequest("c", ids(25 * BS, 9), SamplingParams(max_tokens=1, ignore_eos=True)))
    assert seen[3][0] == "evicted" and seen[3][1] == seen[2][1]
    assert "no KDA checkpoint at 1" in exported["refused"]
    got = exported["state"]
    assert got.position == len(follow) + 1 and got.first_block == 2 and len(got.mla_blocks) == got.position // BS - 2
    assert before.position == 6 * BS + 6  # the first turn's state: the same rows where both have them
    for mine, theirs in zip(got.mla_blocks, before.mla_blocks, strict=False):
        assert mine.start == theirs.start and torch.equal(mine.rows, theirs.rows)


def test_victim_is_the_default_where_the_engine_says_what_it_evicts_and_refused_elsewhere():
    """``transfer.host.victim`` unset: on for the reference engine, off for vLLM (its block pool
    does not say what it evicts); asked for with vLLM, an error."""
    from disagg.config import load_config

    assert load_config({}).transfer.host.victim is True
    assert load_config({"engine": {"backend": "vllm"}}).transfer.host.victim is False
    assert load_config({"transfer": {"host": {"victim": False}}}).transfer.host.victim is False
    with pytest.raises(ValueError, match="transfer.host.victim needs engine.backend 'reference'"):
        load_config({"engine": {"backend": "vllm"}, "transfer": {"host": {"victim": True}}})


def test_a_write_back_into_a_full_host_tier_keeps_every_piece(threads):  # noqa: F811
    """``disagg.workers.holds`` NOTE 2: the evicted session's keys are released before its
    write-back is stored, so into a host tier full of other objects every piece lands as the
    newest; stored while still held, each would go to the head of the eviction order, where the
    next store (another session's turn, in serving) evicts it."""
    from disagg.config import load_config
    from disagg.engine.factory import build_reference_engine
    from disagg.workers.holds import DeviceHolds
    from kv_transfer.keys import BlockHasher, KeyExtras
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host import HostTier

    engine = build_reference_engine(load_config({"model": {"name": "tiny"}, "engine": {"cache_budget_mb": 10}}))
    host = HostTier(8 << 20, slab_bytes=512 << 10)
    store = StateStore([host], engine.layout)
    hasher = BlockHasher(BS, KeyExtras(engine.model_id))
    holds = DeviceHolds(store, hasher)
    engine.on_resident = holds.on_change
    prompt = ids(10 * BS + 20, 1)
    engine.generate(EngineRequest("a", prompt, SamplingParams(max_tokens=2, ignore_eos=True), keep_state=True))
    ended = engine.computed_tokens("a")
    store.put_state(ended, engine.export_state("a"), hasher)
    engine.release("a")
    assert holds.flush()
    hashes = hasher.block_hashes(ended)
    keys = store.block_keys(hashes) + store.checkpoint_keys(hasher.prefix_digest(ended, len(ended), hashes), True)
    assert all(store.contains_keys(keys)) and host.num_held() >= len(keys)
    sizes = [len(host.get_bytes(key)) for key in keys]
    for key in keys:  # the host tier let them go while the device held them
        assert host.delete(key)
    i = 0
    while host.stats()["num_evictions"] < len(keys):  # full of other objects of the same sizes, so every
        assert host.put_bytes(f"filler{i}", bytes(sizes[i % len(sizes)]))  # piece evicts one
        i += 1
    held_at_put = []
    put_state = store.put_state
    store.put_state = lambda *a, **k: (held_at_put.append(host.num_held()), put_state(*a, **k))[1]
    engine.generate(EngineRequest("c", ids(25 * BS, 9), SamplingParams(max_tokens=1, ignore_eos=True)))
    assert holds.flush()
    assert held_at_put == [0], "nothing was held when the write-back was stored (c is held after it)"
    assert holds.stats()["evicted"] == 1 and holds.stats()["written_back"] == len(keys)
    assert all(store.contains_keys(keys)), "every written-back piece is still in the host tier"
    assert holds.stats()["residents_held"] == 1  # c's (a finished request stays resident), not a's
    holds.close()
    host.close()


@pytest.mark.parametrize("case", ["shared", "moved", "checkpoint", "off"])
def test_a_node_mate_resumes_what_another_device_holds(threads, case):  # noqa: F811
    """``disagg.flow`` NOTE 16, ``disagg.workers.holds`` NOTE 5: two workers of one node (each its
    own engine, one host tier). A's session is resident on A's device and the host tier let its
    state go. B's prompt shares A's document ("shared": a new question on it) or is A's session's
    next turn ("moved": the router sent it to B): B recalls the blocks, A writes them back from
    its device, and B resumes them (at the document's end, or at A's turn end), token-exact
    against a run that never stored anything. "checkpoint": the tier kept the blocks and let
    only the checkpoints go; B names the checkpoints at its blocks' ends, and A writes back the
    one it has and the document's end, no block. Without recalls ("off") B computes it all."""
    from disagg.launch.inprocess import InProcessBackend

    over = {"deployment": {"mode": "aggregated"}, "engine": {"cache_budget_mb": 10},  # as victim_backend's
            "transfer": {"host": {"capacity_mb": 256, "pin_memory": False, "victim": True,
                                  "recall_ms": 0 if case == "off" else 5000}}}
    a = backend(**over)
    b = InProcessBackend(a.config, store=a.store)
    host = a.store.tiers[0]
    doc = ids(10 * BS + 20, 1)
    try:
        async def go():
            out1, _ = await send(a, "a1", doc, "A")
            ended = doc + out1[:-1]
            for key in host.keys():  # the host tier let A's session go; A's device holds it
                if case != "checkpoint" or not key.startswith("mla"):
                    host.delete(key)
            prompt = doc + ids(30, 5) if case != "moved" else ended + out1[-1:] + ids(30, 6)
            out2, last2 = await send(b, "b1", prompt, "B" if case == "shared" else "A")
            return ended, prompt, out2, last2

        ended, prompt, out2, last2 = asyncio.run(go())
        holds = a.decode.holds.stats()
    finally:
        a.shutdown()
        b.shutdown()
    if case == "off":
        assert last2.num_cached_tokens == 0 and holds["recalls_heard"] == 0
    else:
        want = len(ended) if case == "moved" else len(doc)
        assert last2.num_cached_tokens == want and last2.cached_source == "host"
        assert holds["recalls_answered"] == 1
        if case == "checkpoint":
            assert 0 < holds["recalled_objects"] < 10, "checkpoints only: the blocks were there"
        else:
            assert holds["recalled_objects"] >= 10
    out_ref, last_ref = uninterrupted(prompt)
    assert last_ref.num_cached_tokens == 0 and out2 == out_ref


def test_a_session_back_on_its_first_worker_joins_its_device_to_a_mates_turn(threads):  # noqa: F811
    """``disagg.flow`` NOTE 16 with NOTE 11: a session's turn 1 ran on A, turn 2 on B, and turn 3
    comes back to A; the host tier let both go. A's device holds turn 1's blocks, B's device turn
    2's end: A recalls only what lies past its own blocks, looks up with its blocks counted as
    present, and resumes at turn 2's end (A's rows, then B's written back), token-exact."""
    from disagg.launch.inprocess import InProcessBackend

    over = {"deployment": {"mode": "aggregated"}, "engine": {"cache_budget_mb": 9},
            "transfer": {"host": {"capacity_mb": 256, "pin_memory": False, "victim": True, "recall_ms": 5000}}}
    a = backend(**over)
    b = InProcessBackend(a.config, store=a.store)
    host = a.store.tiers[0]
    turn1 = ids(6 * BS + 20, 11)
    try:
        async def go():
            out1, _ = await send(a, "t1", turn1, "S")
            turn2 = turn1 + out1 + ids(90, 12)
            out2, _ = await send(b, "t2", turn2, "S")
            for key in host.keys():
                host.delete(key)
            turn3 = turn2 + out2 + ids(50, 13)
            out3, last3 = await send(a, "t3", turn3, "S")
            return turn2 + out2[:-1], turn3, out3, last3

        ended2, turn3, out3, last3 = asyncio.run(go())
        recalls = a.decode.stats()["worker"]["recall_resumes"]
    finally:
        a.shutdown()
        b.shutdown()
    assert recalls == 1 and last3.num_cached_tokens == len(ended2) and last3.cached_source == "host"
    out_ref, _ = uninterrupted(turn3)
    assert out3 == out_ref


def test_a_recall_finds_a_shared_prefix_while_any_resident_holds_it():
    """``disagg.workers.holds`` NOTE 5: two residents that each copied a shared prefix both hold
    its keys. A node mate's recall of the prefix is answered once, by the newest of them; when
    that one is taken back, the other still answers it (the key map had kept one resident per
    key and forgot the prefix with it). The engine's export is replaced by a recorder: which
    resident is asked is what this test is about."""
    from disagg.config import load_config
    from disagg.engine.factory import build_reference_engine
    from disagg.engine.reference.engine import ResidentChange
    from disagg.workers.holds import DeviceHolds
    from kv_transfer.keys import BlockHasher, KeyExtras
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host import HostTier

    engine = build_reference_engine(load_config({"model": {"name": "tiny"}}))
    host = HostTier(8 << 20, slab_bytes=512 << 10)
    store = StateStore([host], engine.layout)
    hasher = BlockHasher(BS, KeyExtras(engine.model_id))
    asked = []
    holds = DeviceHolds(store, hasher, export_fn=lambda rid, position, first: asked.append(rid))
    shared = ids(4 * BS, 21)
    x, y = shared + ids(6 * BS + 10, 22), shared + ids(BS + 10, 23)
    holds.on_change(ResidentChange("kept", 1, "", x, (4 * BS, 10 * BS)))
    holds.on_change(ResidentChange("kept", 2, "", y, (4 * BS, 5 * BS)))
    assert holds.flush()
    for _ in range(200):  # the listener has joined the tier: a recall waits for its answer
        if host.stats()["num_recall_listeners"]:
            break
        time.sleep(0.01)
    asker = shared + ids(2 * BS, 24)

    def recall() -> list[int]:
        asked.clear()
        store.recall(asker, hasher, 0, len(asker), 5.0)
        return asked

    try:
        assert recall() == [2], "both hold the prefix: the newest writes it back, once"
        holds.on_change(ResidentChange("taken", 2, "", y, (4 * BS, 5 * BS)))
        assert holds.flush()
        assert recall() == [1], "the prefix is still held, by the first resident"
        assert host.stats()["num_recall_timeouts"] == 0
    finally:
        holds.close()
        host.close()


def test_a_recall_waits_as_long_as_computing_what_it_asks_for_would_take():
    """``disagg.flow`` NOTE 16: ``recall_ms`` bounds a recall's wait; with an engine profile the
    bound is what the profile says computing the recalled tokens takes, when longer (a long
    context's write-back at K3's bytes a token takes longer than the default 250 ms)."""
    from disagg.config import load_config
    from disagg.costs import cost_profile
    from disagg.flow import FlowOptions

    def options(**router):
        return FlowOptions.from_config(load_config({"router": router, "transfer": {"host": {"victim": True}}}))

    plain, k3 = options(), options(engine_profile="mi355x-k3")
    assert plain.recall_wait_s(131072, 0) == plain.recall_wait_s(1024, 0) == 0.25
    long = cost_profile("mi355x-k3").prefill_time(131072, 0)
    assert long > 1.0 and k3.recall_wait_s(131072, 0) == long
    assert k3.recall_wait_s(1024, 0) == 0.25, "a short recall keeps recall_ms"
    off = {"router": {"engine_profile": "mi355x-k3"}, "transfer": {"host": {"victim": False}}}
    assert FlowOptions.from_config(load_config(off)).recall_wait_s(131072, 0) == 0, "no recalls without victim"
    assert FlowOptions.from_config(load_config({})).recall_s == 0.25, "victim is the reference engine's default"


def test_a_write_back_past_the_queue_cap_is_queued_when_nothing_is_ahead_of_it():
    """``disagg.workers.holds`` NOTE 2: the cap on queued write-backs drops one that would wait
    behind others past it, never one alone (a K3 session of 128K tokens, about 1.9 GB, was
    dropped whole by the 1 GiB cap). The store's put is replaced by one that waits for the test
    (a slow host tier), and the engine's export by states that only have a size."""
    from types import SimpleNamespace

    from disagg.config import load_config
    from disagg.engine.factory import build_reference_engine
    from disagg.engine.reference.engine import ResidentChange
    from disagg.workers.holds import DeviceHolds
    from kv_transfer.keys import BlockHasher, KeyExtras
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host import HostTier

    engine = build_reference_engine(load_config({"model": {"name": "tiny"}}))
    host = HostTier(8 << 20, slab_bytes=512 << 10)
    store = StateStore([host], engine.layout)
    gate, stored = threading.Event(), []

    def slow_put(tokens, state, hasher):
        gate.wait(10)
        stored.append(state.position)
        return SimpleNamespace(num_stored=1, bytes_stored=state.nbytes)

    store.put_state = slow_put
    holds = DeviceHolds(store, BlockHasher(BS, KeyExtras(engine.model_id)), max_pending_bytes=1000)

    def evicted(rid: int, seed: int) -> ResidentChange:
        return ResidentChange("evicted", rid, "", ids(3 * BS, seed), (2 * BS,),
                              export=lambda position, first: SimpleNamespace(nbytes=5000, position=position))

    try:
        holds.on_change(evicted(1, 31))  # five times the cap, nothing queued: queued
        holds.on_change(evicted(2, 32))  # behind it, past the cap: dropped
        gate.set()
        assert holds.flush()
        stats = holds.stats()
        assert stored == [2 * BS] and stats["written_back"] == 1 and stats["write_back_dropped"] == 1
        assert stats["pending_bytes"] == 0
    finally:
        gate.set()
        holds.close()
        host.close()


def test_the_recall_listener_stops_quietly_when_the_tier_server_goes(caplog):
    """At a node's shutdown the host tier's server can close before a worker's holds do: the
    listener stops (a closed connection gets no more recalls) instead of logging a traceback."""
    import logging

    from disagg.config import load_config
    from disagg.engine.factory import build_reference_engine
    from disagg.workers.holds import DeviceHolds
    from kv_transfer.keys import BlockHasher, KeyExtras
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host import HostTier
    from kv_transfer.tiers.host_ipc import HostTierClient, HostTierServer

    engine = build_reference_engine(load_config({"model": {"name": "tiny"}, "engine": {"cache_budget_mb": 10}}))
    owner = HostTier(8 << 20, slab_bytes=512 << 10)
    server = HostTierServer(owner)
    client = HostTierClient(server.socket_path)
    holds = DeviceHolds(StateStore([client], engine.layout), BlockHasher(BS, KeyExtras(engine.model_id)),
                        export_fn=engine.export_resident)
    try:
        assert holds._listener is not None
        deadline = time.monotonic() + 10
        while not owner.stats()["num_recall_listeners"] and time.monotonic() < deadline:  # it listens
            time.sleep(0.01)
        assert owner.stats()["num_recall_listeners"] == 1 and holds._listener.is_alive()
        with caplog.at_level(logging.INFO, logger="disagg.workers.holds"):
            server.close()
            holds._listener.join(timeout=10)
        assert not holds._listener.is_alive()
        assert [r.levelname for r in caplog.records if r.name == "disagg.workers.holds"] == ["INFO"]
        assert holds.stats()["errors"] == 0
    finally:
        holds.close()
        client.close()
        owner.close()
