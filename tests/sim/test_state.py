"""Checkpoint placement, resume across tiers, and prompt-end (tail) resume points."""

from __future__ import annotations

import pytest

from disagg.costs.model import CostModel
from disagg.router.index import PrefixIndex
from disagg.tools.sim.cache import LRUTier, NodeView
from disagg.tools.sim.state import CheckpointPolicy, PromptState, StateModel
from disagg.tools.sim.workload import extend_digests, tail_digest

BS = 64
COST = CostModel(bytes_per_token=100.0, checkpoint_bytes=3 * 64 * 100.0,  # a checkpoint = 3 blocks of capacity
                 bandwidth_gbps={"host": 1.0, "disk": 0.1, "remote": 1.0}, latency_s={"host": 0.0, "disk": 0.0})


def prompt(ids: list[int], plen: int, probes=()) -> PromptState:
    return PromptState(extend_digests([], ids, -(-plen // BS)), plen, BS, list(probes))


def model(policy: CheckpointPolicy) -> StateModel:
    return StateModel(COST, policy, BS, PrefixIndex())


@pytest.mark.parametrize(
    ("policy", "plen", "from_pos", "expected"),
    [
        (CheckpointPolicy(every_blocks=2, last_full_block=False), 6 * BS + 10, 0, [2, 4, 6]),
        (CheckpointPolicy(every_blocks=2, last_full_block=False), 6 * BS, 0, [2, 4]),  # p < plen only
        (CheckpointPolicy(every_blocks=2, last_full_block=False), 6 * BS + 10, 3 * BS, [4, 6]),
        (CheckpointPolicy(every_blocks=4, last_full_block=True), 6 * BS + 10, 0, [4, 6]),
        (CheckpointPolicy(every_blocks=0, last_full_block=True), 6 * BS, 0, []),  # aligned: no last full block
    ],
)
def test_aligned_checkpoint_positions(policy, plen, from_pos, expected):
    ps = prompt(list(range(10)), plen)
    keys = model(policy).checkpoint_keys(ps, from_pos)
    assert keys == [b"K" + ps.digests[nb - 1] for nb in expected]


def test_prompt_end_checkpoint_is_a_tail_when_unaligned():
    pol = CheckpointPolicy(every_blocks=0, last_full_block=False, prompt_end=True)
    ps = prompt(list(range(10)), 3 * BS + 5)
    assert model(pol).checkpoint_keys(ps, 0) == [b"T" + tail_digest(ps.digests[3], 5)]
    aligned = prompt(list(range(10)), 3 * BS)
    assert model(pol).checkpoint_keys(aligned, 0) == [b"K" + aligned.digests[2]]


def test_resume_reads_device_then_host_and_charges_the_slow_part():
    sm = model(CheckpointPolicy(every_blocks=2, last_full_block=False))
    dev, host = LRUTier("device", 100), LRUTier("host", 100)
    first = prompt(list(range(5)), 5 * BS)
    sm.store(first, 0, dev, host)  # blocks 0..4, checkpoints at 2 and 4 blocks
    dev.discard(first.digests[0])  # block 0 only on the host now
    nxt = prompt(list(range(5)) + [50, 51], 7 * BS)
    res = sm.resume(nxt, dev, host, None)
    assert (res.tokens, res.tier) == (4 * BS, "host")
    assert res.nbytes == BS * 100.0  # one block from the host; the checkpoint is on the device
    assert res.load_s == pytest.approx(BS * 100.0 / 1e9)
    assert first.digests[0] in dev  # resumed blocks are copied into the device tier


def test_resume_stops_at_the_first_missing_block_and_needs_a_checkpoint():
    sm = model(CheckpointPolicy(every_blocks=2, last_full_block=False))
    dev = LRUTier("device", 100)
    first = prompt(list(range(6)), 6 * BS + 1)
    sm.store(first, 0, dev, None)  # checkpoints at 2, 4 and 6 blocks
    dev.discard(first.digests[3])
    assert sm.resume(prompt(list(range(6)), 6 * BS + 30), dev, None, None).tokens == 2 * BS
    dev.discard(b"K" + first.digests[1])  # the checkpoint at 2 blocks evicted too
    assert sm.resume(prompt(list(range(6)), 6 * BS + 30), dev, None, None).tokens == 0


def test_resume_at_an_unaligned_prompt_end_through_a_probe():
    pol = CheckpointPolicy(every_blocks=0, last_full_block=False, prompt_end=True)
    sm = model(pol)
    dev, host, disk = LRUTier("device", 100), LRUTier("host", 100), LRUTier("disk", 100)
    first = prompt([1, 2, 3, 4], 3 * BS + 20)
    sm.store(first, 0, dev, host)
    end = sm.prompt_end_key(first)
    assert end == (3 * BS + 20, tail_digest(first.digests[3], 20))
    grown = [1, 2, 3, 4, 9, 9]  # the partial block keeps its id, so its first 20 tokens are equal
    ps = prompt(grown, 5 * BS, [(end[0], tail_digest(extend_digests([], grown, 4)[3], 20))])
    fresh = LRUTier("device", 100)  # another worker of the node: everything from the host
    res = sm.resume(ps, fresh, host, disk)
    assert (res.tokens, res.tier) == (3 * BS + 20, "host")
    assert res.nbytes == 3 * BS * 100.0 + COST.checkpoint_bytes
    no_probe = prompt(grown, 5 * BS)
    assert sm.resume(no_probe, LRUTier("device", 100), host, disk).tokens == 0


def test_index_sees_what_the_tiers_hold():
    index = PrefixIndex()
    sm = StateModel(COST, CheckpointPolicy(every_blocks=2, last_full_block=False), BS, index)
    index.add_worker("w0", "n0")
    dev = LRUTier("device", 9, sm.listener("device", "w0"))
    first = prompt(list(range(4)), 4 * BS + 3)
    sm.store(first, 0, dev, None)  # 4 blocks + 2 checkpoints x 3 units = 10 > 9: block 0 evicted
    assert first.digests[0] not in dev
    from disagg.router.types import RouteRequest

    rr = RouteRequest("r", "s", first.full(), first.prompt_len, BS)
    assert index.resumable(rr, "w0") == (0, None)  # the index saw the eviction of block 0
    assert sm.num_events == 4 + 2 + 1


def test_a_peer_resume_is_charged_at_the_remote_link_and_a_dry_one_copies_nothing():
    """``remote``: the node tiers given are another node's; ``dry``: measured, not copied."""
    cost = CostModel(bytes_per_token=100.0, checkpoint_bytes=3 * 64 * 100.0,
                     bandwidth_gbps={"host": 10.0, "disk": 0.1, "remote": 1.0},
                     latency_s={"host": 0.0, "disk": 0.0, "remote": 0.0})
    sm = StateModel(cost, CheckpointPolicy(every_blocks=2, last_full_block=False), BS, PrefixIndex())
    far_dev, far_host, dev = LRUTier("device", 100), LRUTier("host", 100), LRUTier("device", 100)
    first = prompt(list(range(5)), 5 * BS)
    sm.store(first, 0, far_dev, far_host)
    nxt = prompt(list(range(5)) + [7], 6 * BS)
    dry = sm.resume(nxt, dev, far_host, None, remote=True, dry=True)
    assert (dry.tokens, dry.tier) == (4 * BS, "remote") and len(dev) == 0
    got = sm.resume(nxt, dev, far_host, None, remote=True)
    nbytes = 4 * BS * 100.0 + cost.checkpoint_bytes
    assert (got.tokens, got.tier, got.nbytes) == (4 * BS, "remote", nbytes)
    assert got.load_s == pytest.approx(nbytes / 1e9)  # the remote link, not the host's 10 GB/s
    assert all(d in dev for d in nxt.digests[:4])


def test_extra_positions_join_the_policy_checkpoints_in_position_order():
    """Learned positions: block boundaries past the resume and short of the prompt end, once each."""
    ps = PromptState([bytes([i]) * 16 for i in range(10)], 9 * 64 + 5, 64, [])
    sm = model(CheckpointPolicy(every_blocks=4, last_full_block=True, prompt_end=False))
    keys = sm.checkpoint_keys(ps, 64, extra=(0, 64, 128, 256, 300, 9 * 64 + 5, 9 * 64))
    # 128 (learned), 256 (learned and periodic), 512 (periodic), 576 (last full block and learned)
    assert keys == [b"K" + ps.digests[i] for i in (1, 3, 7, 8)]


def test_a_read_from_a_node_mates_device_is_charged_its_write_back_too():
    """Simulator NOTE 12: what a worker resumes from a node mate's device (``NodeView``), and not
    from the host tier, serving gets by a recall: the mate writes it back into the host tier, then
    the worker reads it. So it costs a host transfer more than the same read from the host tier;
    what the host tier holds costs the read alone."""
    sm = model(CheckpointPolicy(every_blocks=2, last_full_block=False))
    first = prompt(list(range(5)), 5 * BS)
    nxt = prompt(list(range(5)) + [50, 51], 7 * BS)
    mate, host = LRUTier("device", 100), LRUTier("host", 100)
    sm.store(first, 0, mate, host)  # blocks 0..4 and checkpoints at 2 and 4 blocks, on both
    from_host = sm.resume(nxt, LRUTier("device", 100), host, None, dry=True)
    read = 4 * BS * 100.0 + COST.checkpoint_bytes
    assert (from_host.tokens, from_host.load_s) == (4 * BS, pytest.approx(read / 1e9))
    view = NodeView(host, [mate])
    assert sm.resume(nxt, LRUTier("device", 100), view, None, dry=True).load_s == pytest.approx(read / 1e9)
    for key in host.keys()[:]:  # the host tier let them go; the mate's device still holds them
        host.discard(key)
    recalled = sm.resume(nxt, LRUTier("device", 100), view, None, dry=True)
    assert (recalled.tokens, recalled.tier) == (4 * BS, "host")
    assert recalled.load_s == pytest.approx(2 * read / 1e9), "written back, then read"
