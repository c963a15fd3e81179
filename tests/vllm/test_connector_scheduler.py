"""The K3 state connector under vLLM 0.33's real Scheduler (tiny Kimi Linear: MLA + 3 KDA groups).

The forward pass is the harness's deterministic stand-in (no GPU here); block
tables, hits, allocation, delayed frees and recompute-on-failure are vLLM's.
"""

from __future__ import annotations

import uuid

import k3_harness as H
import pytest
from k3_harness import GatedTier, baseline, make_tier

pytestmark = pytest.mark.vllm


def _snapshot(tier) -> dict:
    return {k: tier.get_bytes(k) for k in tier.keys()}


def _keys(tier, kind: str) -> list[str]:
    return sorted(k for k in tier.keys() if k.startswith(kind + ":"))


def _digest_key(engine, tokens, position, kind, shard="") -> str:
    from kv_transfer.keys import ObjectKey

    hasher = engine.connector._sched.hasher(None)
    if kind == "mla":
        digest = hasher.block_hashes(tokens)[position // hasher.block_size - 1]
    else:
        digest = hasher.prefix_digest(tokens, position)
    return str(ObjectKey(kind, digest, shard))


P = H.prompt(700, seed=1)


@pytest.fixture(scope="module")
def produced():
    """Engine A ran a 700-token prompt (3 outputs): boundary save at 640, finish save at 702."""
    name, tier = make_tier()
    a = H.Engine(H.vllm_config(role="kv_producer", tier=name, engine_id="A"))
    a.add("a", P, max_tokens=3)
    a.run()
    return a, _snapshot(tier)


@pytest.fixture(scope="module")
def next_turn(produced):
    a, _ = produced
    return P + a.outputs["a"][:2] + H.prompt(50, seed=2)  # the conversation's next prompt


def test_producer_saves_boundary_and_finish_state(produced):
    a, data = produced
    saves = [j for s in a.step_log for j in s["saves"]]
    assert [(j.reason, j.position) for j in saves] == [("boundary", 640), ("finish", 702)]
    tokens = a.tokens["a"]
    # blocks 1-5, the KDA checkpoints at 640 and 702, the tail 640..702: nothing else
    expected = {_digest_key(a, tokens, 128 * i, "mla") for i in range(1, 6)}
    expected |= {_digest_key(a, tokens, 640, "kda", "tp0of1"), _digest_key(a, tokens, 702, "kda", "tp0of1"),
                 _digest_key(a, tokens, 702, "tail")}
    assert set(data) == expected
    # the finish save gathered only the block not already stored (first_block 5)
    assert saves[1].first_block == 5 and saves[1].mla_block_ids == {0: [a.tables["a"][0][5]]}


@pytest.mark.parametrize("remove, salt, expected", [
    ([], None, 702),                                   # blocks + tail + KDA at 702
    ([("kda", 702)], None, 640),                       # no checkpoint at 702 -> the aligned one at 640
    ([("tail", 702)], None, 640),                      # no MLA tail rows for 702 -> 640
    ([("kda", 640), ("kda", 702)], None, 0),           # MLA blocks without any KDA checkpoint
    ([("mla", 384)], None, 0),                         # a missing MLA block before every checkpoint
    ([], "tenant-b", 0),                               # another tenant's salt: other keys
])
def test_hit_needs_mla_blocks_and_aligned_kda_checkpoint(produced, next_turn, remove, salt, expected):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    a, data = produced
    name, tier = make_tier(data=data)
    for kind, pos in remove:
        tier.delete(_digest_key(a, a.tokens["a"], pos, kind, "tp0of1" if kind == "kda" else ""))
    b = H.Engine(H.vllm_config(role="kv_consumer", tier=name, engine_id="B"))
    req = Request("q", next_turn, SamplingParams(max_tokens=1), None, block_hasher=b.block_hasher, cache_salt=salt)
    n, load_async = b.connector.get_num_new_matched_tokens(req, 0)
    assert (n, load_async) == (expected, expected > 0)
    if expected:  # vLLM passes its block-aligned local hit: only what lies beyond it is claimed
        assert b.connector.get_num_new_matched_tokens(req, 640)[0] == expected - 640


def test_resumed_turn_receives_the_right_blocks(produced, next_turn):
    a, data = produced
    name, _ = make_tier(data=data)
    b = H.Engine(H.vllm_config(role="kv_both", tier=name, engine_id="B"))
    b.add("b", next_turn, max_tokens=3)
    b.step()  # lookup + async load (the request waits for its KV; nothing is computed)
    (load,) = b.step_log[0]["loads"]
    assert load.position == 702 and load.first_block == 0
    table = b.tables.get("b") or [list(x) for x in b.sched.kv_cache_manager.get_block_ids("b")]
    assert load.mla_block_ids == {0: table[0][:6]}  # pages of blocks 0..5 (5 = the tail's block)
    assert load.kda_block_ids == {g: table[g][5] for g in (1, 2, 3)}  # state after 702 at index 5
    assert b.step_log[0]["recving"] == {"b"} and not b.step_log[0]["failed"]
    b.tables["b"] = [list(x) for x in b.sched.kv_cache_manager.get_block_ids("b")]
    assert all(H.bits_equal(x, y) for x, y in zip(b.mla_rows("b", 0, 702), a.mla_rows("a", 0, 702), strict=True))
    assert all(H.bits_equal(x, y) for x, y in zip(b.kda_state("b", 702), a.kda_state("a", 702), strict=True))
    b.run()
    assert b.step_log[1]["scheduled"] == {"b": len(next_turn) - 702}  # only the new tokens are computed
    assert b.outputs["b"] == baseline(next_turn, 3)


def test_partial_tail_is_saved_with_its_kda_state():
    """prefix_match_unit 64 < block 128: vLLM checkpoints at 960 inside block 7 (a partial tail)."""
    name, tier = make_tier()
    p = H.prompt(1000, seed=3)
    a = H.Engine(H.vllm_config(role="kv_producer", tier=name, engine_id="A", pmu=64))
    a.add("a", p, max_tokens=2)
    a.run()
    boundary = [(j.reason, j.position) for s in a.step_log for j in s["saves"] if j.reason == "boundary"]
    assert boundary == [("boundary", 896), ("boundary", 960)]
    assert _digest_key(a, p, 960, "tail") in tier.keys()
    assert _digest_key(a, p, 960, "kda", "tp0of1") in tier.keys()
    q = p[:980] + H.prompt(40, seed=4)
    b = H.Engine(H.vllm_config(role="kv_consumer", tier=name, engine_id="B", pmu=64))
    b.add("b", q, max_tokens=3)
    b.run()
    (load,) = b.step_log[0]["loads"]
    assert load.position == 960
    assert b.outputs["b"] == baseline(q, 3, pmu=64)


def test_finished_partial_tail_of_an_aborted_prefill():
    """A prefill aborted right at its unaligned checkpoint: vLLM hands the table block over
    (register_finished_partial_tail); it is saved and unpinned once the worker reports it."""
    from vllm.v1.request import RequestStatus

    name, tier = make_tier()
    p = H.prompt(1000, seed=5)
    a = H.Engine(H.vllm_config(role="kv_producer", tier=name, engine_id="A", pmu=64))
    free0 = a.num_free_blocks()
    a.add("a", p, max_tokens=2)
    a.step()
    a.step()  # computed 896 + 64 = 960: the prompt's last checkpoint, unaligned
    assert a.sched.requests["a"].num_computed_tokens == 960
    a.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert a.connector._sched.num_pinned_jobs() == 1  # the tail job holds its blocks
    a.run()
    tails = [j for s in a.step_log for j in s["saves"] if j.reason == "partial_tail"]
    assert [j.position for j in tails] == [960]
    assert not [j for s in a.step_log for j in s["saves"] if j.reason == "finish"]  # no duplicate at 960
    assert _digest_key(a, p, 960, "tail") in tier.keys() and _digest_key(a, p, 960, "kda", "tp0of1") in tier.keys()
    assert a.connector._sched.num_pinned_jobs() == 0 and a.num_free_blocks() == free0


def test_blocks_are_freed_only_after_saves_finish():
    from kv_transfer.vllm.stores import register_local_tier

    tier = GatedTier()
    name = f"gated-{uuid.uuid4().hex[:8]}"
    register_local_tier(name, tier)
    a = H.Engine(H.vllm_config(role="kv_producer", tier=name, engine_id="A", extra={"async_saves": True}))
    total = a.num_free_blocks()
    a.add("a", P, max_tokens=1)
    for _ in range(6):
        a.step()
    assert "a" in a.finished  # the request is done ...
    assert "a" in a.sched.requests  # ... but vLLM keeps it (delayed free) while its save runs
    assert a.connector._sched.num_pinned_jobs() == 1  # the 640 boundary save pins its blocks
    held = total - a.num_free_blocks()
    assert held >= 6  # MLA pages of 0..700 + the KDA state blocks
    assert a.connector.has_pending_push_work()
    tier.gate.set()
    a.run()
    assert "a" not in a.sched.requests and a.connector._sched.num_pinned_jobs() == 0
    assert a.num_free_blocks() == total
    assert any("a" in s["sending"] for s in a.step_log)
    assert len(tier.inner.keys()) == 8  # 5 blocks + kda@640, then tail + kda @700


def test_corrupt_object_turns_into_recompute(produced, next_turn):
    """Hybrid layout: vLLM maps load failures through failed_recving (block ids are per group)."""
    from kv_transfer.codec import HEADER_BYTES

    a, data = produced
    name, tier = make_tier(data=data)
    key = _digest_key(a, a.tokens["a"], 256, "mla")
    bad = bytearray(tier.get_bytes(key))
    bad[HEADER_BYTES + 100] ^= 0x10
    tier.delete(key)
    tier.put_bytes(key, bytes(bad))
    b = H.Engine(H.vllm_config(role="kv_consumer", tier=name, engine_id="B"))
    b.add("b", next_turn, max_tokens=3)
    b.run()
    assert b.step_log[0]["failed"] == {"b"} and b.step_log[0]["invalid"] == set()
    assert b.step_log[1]["scheduled"]["b"] > 0 and sum(s["scheduled"].get("b", 0) for s in b.step_log) >= len(next_turn)
    assert b.outputs["b"] == baseline(next_turn, 3)  # never a wrong token
    assert key not in tier.keys()  # the corrupt object was dropped from its tier
    assert b.worker._worker.counters["load_failures"] == 1
    removed = [e for e in b.published if type(e).__name__ == "BlockRemoved"]
    assert [e.ownership for e in removed] == [key]


def test_corrupt_object_surfaces_in_block_ids_with_load_errors_single_group():
    """One KV cache group (pure MLA): the failed blocks go to get_block_ids_with_load_errors and
    vLLM recomputes from the first of them."""
    from kv_transfer.codec import HEADER_BYTES

    name, tier = make_tier()
    p = H.prompt(600, seed=7)
    a = H.Engine(H.vllm_config(role="kv_producer", tier=name, engine_id="A"), mla_only=True)
    a.add("a", p, max_tokens=2)
    a.run()
    q = p + a.outputs["a"][:1] + H.prompt(30, seed=8)
    key = _digest_key(a, a.tokens["a"], 128, "mla")
    bad = bytearray(tier.get_bytes(key))
    bad[HEADER_BYTES + 7] ^= 0x01
    tier.delete(key)
    tier.put_bytes(key, bytes(bad))
    b = H.Engine(H.vllm_config(role="kv_consumer", tier=name, engine_id="B"), mla_only=True)
    b.add("b", q, max_tokens=3)
    b.run()
    (load,) = b.step_log[0]["loads"]
    assert b.step_log[0]["invalid"] == set(load.mla_block_ids[0]) and not b.step_log[0]["failed"]
    assert b.outputs["b"] == baseline(q, 3, mla_only=True)


def test_take_events_feed_the_router_index(produced, next_turn):
    """The producer's stored objects, as vLLM KV events, make the router see the turn end."""
    from disagg.router.index import PrefixIndex
    from disagg.router.types import RouteRequest, TailProbe
    from kv_transfer.vllm.events import store_event_from_vllm

    a, data = produced
    events = [e for e in a.published if getattr(e, "ownership", None)]  # ours (vLLM's GPU events have none)
    assert {type(e).__name__ for e in events} == {"BlockStored"} and {e.medium for e in events} == {"CPU"}
    assert sorted(e.ownership for e in events) == sorted(data)  # one event per stored object
    assert list(a.connector.take_events()) == []  # vLLM drained them every step
    index = PrefixIndex()
    index.add_worker("A", node_id="node-1")
    index.apply_many(e for e in (store_event_from_vllm(ev, "A") for ev in events) if e is not None)
    hasher = a.connector._sched.hasher(None)
    probe = TailProbe(702, hasher.prefix_digest(next_turn, 702))
    req = RouteRequest("r", block_hashes=hasher.block_hashes(next_turn), prompt_len=len(next_turn),
                       block_size=128, tail_probes=[probe])
    assert index.resumable(req, "A") == (702, "host")
    no_tail = RouteRequest("r", block_hashes=hasher.block_hashes(next_turn), prompt_len=len(next_turn), block_size=128)
    assert index.resumable(no_tail, "A") == (640, "host")


def test_every_steps_metadata_starts_its_jobs():
    """The worker starts each step's jobs once, whichever address the step's metadata has:
    a freed step's metadata often hands its address to the next one (CPython reuses it at once),
    and a load missed that way left its request waiting for remote state forever."""
    from kv_transfer.vllm_connector import K3ConnectorMetadata

    class Recorder:  # stands in for WorkerSide: records which jobs the connector started
        def __init__(self):
            self.loads, self.saves = [], []

        def begin_saves(self, saves):
            self.saves.extend(saves)

        def start_loads(self, loads):
            self.loads.extend(loads)

        def save_layer(self, layer_name):
            pass

        def finish_saves(self):
            pass

    name, _ = make_tier()
    w = H.Engine(H.vllm_config(role="kv_consumer", tier=name, engine_id="decode-0")).worker
    w._worker = rec = Recorder()
    for step in range(50):
        w.bind_connector_metadata(K3ConnectorMetadata(loads=[f"load-{step}"], saves=[f"save-{step}"]))
        w.start_load_kv(None)
        w.save_kv_layer("layer", None, None)  # a later hook of the same step: nothing starts twice
        w.wait_for_save()
        w.clear_connector_metadata()
    assert rec.loads == [f"load-{i}" for i in range(50)]
    assert rec.saves == [f"save-{i}" for i in range(50)]
