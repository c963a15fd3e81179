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
        store(idx, "kda", h[1], "device", w)
    _blocks(idx, h, "device", "w0")
    m = idx.match(req(h, 6 * BS + 1), ["w0", "w1", "w2", "w3"], common_min=3)
    assert m.common_blocks == 2
    assert [m.matches[w].mla_blocks for w in ("w0", "w1", "w2", "w3")] == [6, 2, 2, 0]


def test_common_prefix_is_what_most_workers_resume_not_only_read():
    """A shared document's blocks in every node's host tier, its checkpoint on one device: no
    common prefix, so the worker that resumes it is told apart from those that would recompute it
    (index NOTE 8); an attention-only index resumes any block it reads."""
    nodes = {"p0": "n0", "p1": "n0", "p2": "n1", "p3": "n1"}
    h = chain(6)

    def document(hybrid: bool = True) -> PrefixIndex:
        idx = PrefixIndex(hybrid=hybrid)
        for w, n in nodes.items():
            idx.add_worker(w, n)
        _blocks(idx, h, "host", "p0")
        _blocks(idx, h, "host", "p2")
        store(idx, "kda", h[5], "device", "p0")
        return idx

    for hybrid in (True, False):
        m = document(hybrid).match(req(h, 6 * BS + 1), list(nodes), common_min=3)
        assert [m.matches[w].mla_blocks for w in nodes] == [6, 6, 6, 6]
        assert m.common_blocks == (0 if hybrid else 6)
    idx = document()
    store(idx, "kda", h[3], "host", "p2")  # node n1 resumes 4 blocks, p0 6, p1 nothing
    m = idx.match(req(h, 6 * BS + 1), list(nodes), common_min=3)
    assert [m.matches[w].resumable_tokens for w in nodes] == [6 * BS, 0, 4 * BS, 4 * BS]
    assert m.common_blocks == 4  # three resume at least 4 blocks
    assert idx.match(req(h, 6 * BS + 1), list(nodes), common_min=4).common_blocks == 0


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


# ---- the walk against a brute-force reference -------------------------------------


def _reference(stored, nodes, req_, cands, common_min, hybrid=True):
    """Per worker (resumable, tier, mla_blocks) straight from the stored objects."""
    order = ("device", "host", "disk", "remote")

    def fastest(w, kind, digest):
        tiers = [t for (k, d, t, who) in stored if k == kind and d == digest and (
            (t == "device" and who == w) or (t in ("host", "disk") and nodes[who] == nodes[w]) or t == "remote")]
        return min((order.index(t) for t in tiers), default=None)

    bs, plen, hs = req_.block_size, req_.prompt_len, req_.block_hashes
    out = {}
    for w in cands:
        tiers = []
        for h in hs:
            t = fastest(w, "mla", h)
            if t is None:
                break
            tiers.append(t)
        best = (0, None)
        for k in range(1, len(tiers) + 1):
            t = fastest(w, "kda", hs[k - 1]) if hybrid else 0  # pure attention: any block prefix resumes
            if k * bs < plen and t is not None:
                best = (k * bs, order[max(tiers[:k] + [t])])
        for probe in req_.tail_probes:
            k = probe.position // bs
            tt, tk = fastest(w, "tail", probe.digest), fastest(w, "kda", probe.digest) if hybrid else 0
            if k <= len(tiers) and tt is not None and tk is not None and probe.position > best[0]:
                best = (probe.position, order[max(tiers[:k] + [tt, tk])])
        out[w] = (*best, len(tiers))
    common = 0
    for h in hs:
        if sum(fastest(w, "mla", h) is not None for w in cands) < common_min:
            break
        common += 1
    if hybrid and common:  # ... and resumed by common_min of them (index NOTE 8)
        kth = sorted((out[w][0] for w in cands), reverse=True)[common_min - 1]
        common = min(common, kth // bs)
    return out, common


@pytest.mark.parametrize("seed", range(40))
def test_walk_matches_reference(seed):
    _walk_against_reference(seed)


@pytest.mark.parametrize("hybrid, pad", [(False, 0), (True, 130), (False, 70)])
@pytest.mark.parametrize("seed", range(12))
def test_walk_matches_reference_attention_only_and_past_64_workers(seed, hybrid, pad):
    _walk_against_reference(1000 + seed, hybrid, pad)


def _walk_against_reference(seed: int, hybrid: bool = True, pad: int = 0) -> None:
    """Random stores and evictions over 5 workers on 3 nodes; ``pad`` workers registered first push
    their bits past the first 64-bit mask word."""
    import random

    rng = random.Random(seed)
    nodes = {"a": "n0", "b": "n0", "c": "n1", "d": "n1", "e": "n2"}
    idx = PrefixIndex(hybrid=hybrid)
    for i in range(pad):
        idx.add_worker(f"pad{i}", "n0" if i % 2 else f"pad-node{i}")  # some share n0 (node masks span words)
    for w, n in nodes.items():
        idx.add_worker(w, n)
    h = chain(10, f"ref{seed}")
    tails = [bytes([seed % 251, i]) * 8 for i in range(3)]
    stored = []
    for _ in range(rng.randint(5, 60)):
        kind = rng.choice(["mla", "mla", "mla", "kda", "tail"])
        digest = rng.choice(tails if kind == "tail" else h + (tails if kind == "kda" else []))
        tier = rng.choice(["device", "device", "host", "disk", "remote"])
        who = rng.choice(list(nodes))
        if rng.random() < 0.15 and stored:  # evict something stored earlier
            k, d, t, w = stored.pop(rng.randrange(len(stored)))
            if not any(x[:3] == (k, d, t) and (t == "remote" or (t == "device" and x[3] == w) or
                                              (t != "device" and nodes[x[3]] == nodes[w])) for x in stored):
                store(idx, k, d, t, w, op="evicted")
            else:
                stored.append((k, d, t, w))  # another reporter still holds it in that scope
            continue
        stored.append((kind, digest, tier, who))
        store(idx, kind, digest, tier, who)
    plen = rng.choice([8 * BS, 10 * BS + 1, 10 * BS + 3, 5 * BS + 2])
    r = req(h[: plen // BS], plen)
    r.tail_probes = [TailProbe(p, t) for p, t in zip((2 * BS + 1, 6 * BS + 3, 9 * BS + 2), tails, strict=True)
                     if p < plen]
    cands = ["a", "b", "c", "d", "e"][: rng.randint(1, 5)]
    common_min = rng.randint(1, 3)
    want, want_common = _reference(stored, nodes, r, cands, common_min, hybrid)
    got = idx.match(r, cands, common_min)
    assert got.common_blocks == want_common
    assert {w: (m.resumable_tokens, m.tier, m.mla_blocks) for w, m in got.matches.items()} == want


def test_popcount_fallback_matches_numpy():
    import numpy as np

    from disagg.router.index import _popcount_swar

    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**63, size=(64, 3), dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, (64, 3), np.uint64)
    x[0, 0], x[1, 1] = 0, np.uint64(2**64 - 1)
    want = [[bin(int(v)).count("1") for v in row] for row in x]
    assert _popcount_swar(x).tolist() == want


def test_remove_worker_objects_and_tier_masks_past_64_workers():
    idx, h = PrefixIndex(), chain(4)
    for i in range(70):
        idx.add_worker(f"w{i}", f"n{i // 8}")
    _blocks(idx, h, "device", "w66")
    store(idx, "kda", h[3], "device", "w66")
    store(idx, "mla", h[0], "host", "w65")  # node n8: w64..w69
    store(idx, "mla", h[1], "remote", "w1")
    assert idx.tier_masks("mla", h[0]) == (1 << 66, 0b111111 << 64, 0, 0)
    assert idx.tier_masks("mla", h[1])[3] == -1 and idx.tier_masks("kda", h[0]) is None
    assert idx.resumable(req(h, 4 * BS + 1), "w66") == (4 * BS, "device")
    idx.remove_worker_objects("w66")
    assert idx.resumable(req(h, 4 * BS + 1), "w66") == (0, None)
    assert idx.num_objects() == {"mla": 2, "kda": 0, "tail": 0}  # h[0] stays on n8's host, h[1] remote


def _table_state(idx: PrefixIndex) -> dict:
    out = {}
    for kind, table in idx._tables.items():
        for key in table._row:
            row = table.row(key)
            link = table.link(row) if kind == "mla" else None
            out[kind, key] = (idx.tier_masks(kind, key), None if link is None else idx._kda.digest(link))
    return out


def test_updater_applies_what_apply_update_applies():
    import random

    from disagg.router.index import IndexUpdate

    rng = random.Random(3)
    h = chain(30)
    slow, fast = PrefixIndex(), PrefixIndex()
    for idx in (slow, fast):
        idx.add_worker("a", "n0")
    producers = [("device", "a"), ("host", "a"), ("host", "n0"), ("disk", "b"), ("remote", "c"), ("device", "n0")]
    updaters = {p: fast.updater(*p) for p in producers}
    for step in range(3000):
        if step == 1000:  # a node mate joins after the updaters were made: n0's host tier reaches it too
            for idx in (slow, fast):
                idx.add_worker("d", "n0")
        tier, reporter = rng.choice(producers)
        op, kind, digest = rng.choice(("stored", "stored", "evicted")), rng.choice(("mla", "kda", "tail")), rng.choice(h)
        slow.apply_update(IndexUpdate(op, kind, digest, tier, reporter))
        updaters[tier, reporter](op == "stored", kind, digest)
        if step % 500 == 0:
            assert _table_state(fast) == _table_state(slow)
    assert _table_state(fast) == _table_state(slow)
    assert fast.num_events == slow.num_events == 3000
    assert fast.worker_ids == slow.worker_ids
    r = req(h, 30 * BS + 1)
    assert fast.match(r, fast.worker_ids, 2).resumable == slow.match(r, slow.worker_ids, 2).resumable
