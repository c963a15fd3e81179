from __future__ import annotations

import pytest

from disagg.router.index import PrefixIndex, update_from_event
from disagg.router.types import TailProbe
from tests.router.helpers import Ev, chain, req, store

BS = 4


def _index(nodes: dict[str, str] | None = None) -> PrefixIndex:
    idx = PrefixIndex()
    for w, n in (nodes or {"a": "n0", "b": "n0", "c": "n1"}).items():
        idx.add_worker(w, n)
    return idx


def _blocks(idx, hashes, tier, worker, upto=None):
    for h in hashes[:upto]:
        store(idx, "mla", h, tier, worker)


def test_resumable_needs_a_checkpoint():
    idx, h = _index(), chain(8)
    _blocks(idx, h, "device", "a")
    r = req(h, 8 * BS + 1)
    assert idx.resumable(r, "a") == (0, None)  # blocks without any KDA checkpoint
    store(idx, "kda", h[3], "device", "a")
    assert idx.resumable(r, "a") == (4 * BS, "device")
    store(idx, "kda", h[7], "device", "a")
    assert idx.resumable(r, "a") == (8 * BS, "device")


def test_missing_block_caps_resume_before_later_checkpoint():
    idx, h = _index(), chain(8)
    _blocks(idx, h, "device", "a")
    store(idx, "kda", h[3], "device", "a")
    store(idx, "kda", h[7], "device", "a")
    store(idx, "mla", h[5], "device", "a", op="evicted")
    assert idx.resumable(req(h, 8 * BS + 1), "a") == (4 * BS, "device")


def test_evicted_checkpoint_falls_back_to_older_one():
    idx, h = _index(), chain(8)
    _blocks(idx, h, "device", "a")
    store(idx, "kda", h[1], "device", "a")
    store(idx, "kda", h[7], "device", "a")
    store(idx, "kda", h[7], "device", "a", op="evicted")
    assert idx.resumable(req(h, 8 * BS + 1), "a") == (2 * BS, "device")


def test_checkpoint_at_prompt_end_is_not_a_resume_point():
    idx, h = _index(), chain(4)
    _blocks(idx, h, "device", "a")
    store(idx, "kda", h[3], "device", "a")
    assert idx.resumable(req(h, 4 * BS), "a") == (0, None)  # p must be < prompt_len


@pytest.mark.parametrize(
    "block_tier, ckpt_tier, expect_tier",
    [
        ("device", "device", "device"),
        ("host", "device", "host"),
        ("device", "disk", "disk"),
        ("disk", "disk", "disk"),
        ("remote", "host", "remote"),
    ],
)
def test_slowest_tier_is_reported(block_tier, ckpt_tier, expect_tier):
    idx, h = _index(), chain(4)
    _blocks(idx, h, "device", "a")
    store(idx, "mla", h[2], block_tier, "a")
    store(idx, "mla", h[2], "device", "a", op="evicted") if block_tier != "device" else None
    store(idx, "kda", h[3], ckpt_tier, "a")
    assert idx.resumable(req(h, 4 * BS + 1), "a") == (4 * BS, expect_tier)


def test_only_on_disk_and_node_sharing():
    idx, h = _index(), chain(4)
    _blocks(idx, h, "disk", "a")
    store(idx, "kda", h[3], "disk", "a")
    r = req(h, 4 * BS + 1)
    res = idx.match(r, ["a", "b", "c"]).matches
    assert (res["a"].resumable_tokens, res["a"].tier) == (16, "disk")
    assert (res["b"].resumable_tokens, res["b"].tier) == (16, "disk")  # same node
    assert (res["c"].resumable_tokens, res["c"].tier) == (0, None)  # other node


def test_remote_tier_is_global_and_moved_events():
    idx, h = _index(), chain(2)
    _blocks(idx, h, "remote", "a")
    store(idx, "kda", h[1], "remote", "a")
    r = req(h, 2 * BS + 1)
    assert idx.resumable(r, "c") == (8, "remote")
    idx.apply(Ev("moved", f"kda:{h[1].hex()}", "device", "c", "kda", from_tier="remote"))
    assert idx.resumable(r, "c") == (8, "remote")  # blocks still remote
    assert idx.resumable(r, "a") == (0, None)  # checkpoint left the remote tier


def test_tail_probe_resume_point():
    idx, h = _index(), chain(3)
    _blocks(idx, h, "device", "a")
    tail = b"\x07" * 16
    store(idx, "tail", tail, "host", "a")
    store(idx, "kda", tail, "device", "a")
    r = req(h, 3 * BS + 3)
    r.tail_probes = [TailProbe(2 * BS + 2, tail)]
    assert idx.resumable(r, "a") == (10, "host")
    r.tail_probes = []
    assert idx.resumable(r, "a") == (0, None)


def test_common_blocks_and_mla_lengths():
    idx, h = _index({f"w{i}": f"n{i}" for i in range(4)}), chain(6)
    for w in ("w0", "w1", "w2"):
        _blocks(idx, h, "device", w, upto=2)
    _blocks(idx, h, "device", "w0")
    m = idx.match(req(h, 6 * BS + 1), ["w0", "w1", "w2", "w3"], common_min=3)
    assert m.common_blocks == 2
    assert [m.matches[w].mla_blocks for w in ("w0", "w1", "w2", "w3")] == [6, 2, 2, 0]


def test_block_overlap_counts_by_fastest_tier():
    idx, h = _index(), chain(5)
    _blocks(idx, h, "device", "a", upto=2)
    for x in h[2:4]:
        store(idx, "mla", x, "host", "a")
    store(idx, "mla", h[4], "disk", "c")
    assert idx.block_overlap(req(h), ["a", "b", "c"]) == {"a": [2, 2, 0, 0], "b": [0, 0, 0, 0], "c": [0, 0, 0, 0]}


def test_adapter_skips_nonzero_shards_and_parses_keys():
    d = b"\x01" * 16
    assert update_from_event(Ev("stored", f"kda:{d.hex()}:tp1of2", "host", "a")) is None
    u = update_from_event(Ev("stored", f"kda:{d.hex()}:tp0of2", "host", "a"))
    assert (u.op, u.object_kind, u.digest, u.tier, u.worker_id) == ("stored", "kda", d, "host", "a")
    with pytest.raises(ValueError):
        PrefixIndex().apply(Ev("bogus", f"mla:{d.hex()}", "device", "a"))
