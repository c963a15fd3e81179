"""The int walk (disagg.router.walk) against the numpy walk: equal MatchResults on random index states."""

from __future__ import annotations

import random

import numpy as np
import pytest

from disagg.router.index import IndexUpdate, PrefixIndex
from disagg.router.types import RouteRequest, TailProbe
from disagg.tools.sim.workload import tail_digest
from tests.router.helpers import chain

BS = 4
TIERS = ("device", "host", "disk", "remote")


def _random_index(rng: random.Random, workers: int, hybrid: bool, hashes: list[bytes]) -> tuple[PrefixIndex, list]:
    idx = PrefixIndex(hybrid=hybrid)
    ids = [f"w{i}" for i in range(workers)]
    for i, w in enumerate(ids):
        idx.add_worker(w, f"n{i // 3}")
    tails = []
    for _ in range(rng.randrange(40, 400)):
        k = rng.randrange(len(hashes))
        tier = rng.choice(TIERS)
        worker = rng.choice(ids + ["n0"]) if tier in ("host", "disk") else rng.choice(ids)
        op = "stored" if rng.random() < 0.75 else "evicted"
        kind = rng.choice(("mla", "mla", "mla", "kda", "tail"))
        digest = hashes[k]
        if kind == "tail":
            off = rng.randrange(1, BS)
            digest = tail_digest(hashes[k], off)
            tails.append(((k) * BS + off, digest))
            idx.apply_update(IndexUpdate(op, "kda", digest, tier, worker))
        idx.apply_update(IndexUpdate(op, kind, digest, tier, worker))
        if kind == "mla" and rng.random() < 0.5:  # long runs of a block on many workers
            for j in range(k, min(k + rng.randrange(1, 12), len(hashes))):
                idx.apply_update(IndexUpdate("stored", "mla", hashes[j], tier, worker))
    return idx, tails


def _fields(m) -> tuple:
    res, tier = m.columns()
    lengths = [m.mla_blocks[i] for i in range(len(m.mla_blocks))]
    return (m.common_blocks, m.worker_ids, m.resumable, m.tiers, list(m.mla_blocks), lengths, res.tolist(),
            tier.tolist(), res.dtype, tier.dtype)


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("workers", [5, 70])  # 70: two mask words
def test_int_walk_equals_numpy_walk(hybrid: bool, workers: int) -> None:
    rng = random.Random(workers * 2 + hybrid)
    for trial in range(25):
        hashes = chain(rng.randrange(1, 40), seed=f"t{trial}")
        idx, tails = _random_index(rng, workers, hybrid, hashes)
        for _ in range(6):
            n = rng.randrange(0, len(hashes) + 1)
            plen = n * BS + rng.choice((0, 1, 3)) if n else rng.randrange(1, 3)
            probes = [TailProbe(p, d) for p, d in rng.sample(tails, min(len(tails), rng.randrange(0, 4)))]
            request = RouteRequest("r", "s", hashes[:n], plen, BS, tail_probes=probes)
            cands = idx.worker_ids if rng.random() < 0.5 else rng.sample(idx.worker_ids, rng.randrange(1, workers))
            if rng.random() < 0.2:
                cands = cands + cands[:2]  # repeated candidates share their bit
            common_min = rng.choice((None, 1, 2, max(1, workers // 2)))
            idx.int_walk_blocks = 0
            numpy_walk = _fields(idx.match(request, cands, common_min))
            idx.int_walk_blocks = 10_000
            int_walk = _fields(idx.match(request, cands, common_min))
            assert int_walk == numpy_walk


def test_int_walk_leaves_numpy_side_pending_until_settled() -> None:
    idx = PrefixIndex()
    idx.add_worker("a", "n0")
    h = chain(8)
    for d in h:
        idx.apply_update(IndexUpdate("stored", "mla", d, "device", "a"))
    idx.apply_update(IndexUpdate("stored", "kda", h[3], "device", "a"))
    table = idx._mla
    pending = len(table._dirty)
    assert pending and idx.match(RouteRequest("r", "s", h, 8 * BS + 1, BS), ["a"]).resumable == [4 * BS]
    assert len(table._dirty) == pending  # no flush: the int walk read the event side
    idx.int_walk_blocks = 0
    assert idx.match(RouteRequest("r", "s", h, 8 * BS + 1, BS), ["a"]).resumable == [4 * BS]
    assert not table._dirty  # the numpy walk flushed
    np.testing.assert_array_equal(table.masks(table.row(h[0]))[0], [1])
