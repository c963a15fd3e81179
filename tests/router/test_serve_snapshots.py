"""Device snapshots in the Serve adapter credit a resident session up to its turn end.

``deployments.request_router.DeviceSnapshots`` is the adapter's pure part (no
Ray calls): replicas' snapshots go into a real ``PrefixIndex`` and requests get
their tail probes from real ``BlockHasher`` digests, as in ``choose_replicas``.
"""

from __future__ import annotations

import random

from deployments.request_router import DeviceSnapshots
from disagg.router.index import PrefixIndex
from disagg.router.types import RouteRequest
from kv_transfer.keys import BlockHasher, KeyExtras

BS = 16
H = BlockHasher(BS, KeyExtras("tiny-test"))
RNG = random.Random(0)
SESSION = [RNG.randrange(1000) for _ in range(3 * BS + 5)]  # a turn end inside block 4
OTHER = [RNG.randrange(1000) for _ in range(2 * BS + 9)]


def _report(tokens: list[int], with_tail: bool) -> tuple[list[str], list | None]:
    """What a replica reports for one resident session: block digests (and the turn end)."""
    blocks = [h.hex() for h in H.block_hashes(tokens)]
    tail = [len(tokens), H.prefix_digest(tokens, len(tokens)).hex()] if with_tail and len(tokens) % BS else None
    return blocks, tail


def _apply(snaps: DeviceSnapshots, worker: str, sessions: list[list[int]], with_tail: bool = True) -> None:
    reports = [_report(s, with_tail) for s in sessions]
    snaps.apply(worker, [b for b, _ in reports], [t for _, t in reports] if with_tail else None)


def _resume(idx: PrefixIndex, snaps: DeviceSnapshots, prompt: list[int], worker: str) -> tuple[int, str | None]:
    hashes = H.block_hashes(prompt)
    req = RouteRequest("r", "s", hashes, len(prompt), BS, snaps.tail_probes(H, prompt, hashes))
    return idx.resumable(req, worker)


def _index() -> tuple[PrefixIndex, DeviceSnapshots]:
    idx = PrefixIndex()
    for w in ("a", "b"):
        idx.add_worker(w, "n0")
    return idx, DeviceSnapshots(idx)


def test_resident_session_resumes_at_its_turn_end():
    idx, snaps = _index()
    _apply(snaps, "a", [SESSION, OTHER])
    next_turn = SESSION + [7] * 30
    assert _resume(idx, snaps, next_turn, "a") == (len(SESSION), "device")
    assert _resume(idx, snaps, next_turn, "b") == (0, None)  # device state is the replica's own
    assert _resume(idx, snaps, OTHER + [1] * 40, "a") == (len(OTHER), "device")


def test_without_reported_tails_the_last_full_block_is_credited():
    idx, snaps = _index()
    _apply(snaps, "a", [SESSION], with_tail=False)
    assert _resume(idx, snaps, SESSION + [7] * 30, "a") == (3 * BS, "device")


def test_a_prompt_that_leaves_the_session_inside_the_tail_gets_no_probe():
    idx, snaps = _index()
    _apply(snaps, "a", [SESSION])
    diverged = SESSION[:-2] + [SESSION[-2] + 1, SESSION[-1]] + [7] * 30
    hashes = H.block_hashes(diverged)
    assert snaps.tail_probes(H, diverged, hashes) == []
    assert _resume(idx, snaps, diverged, "a") == (3 * BS, "device")
    assert snaps.tail_probes(H, SESSION, H.block_hashes(SESSION)) == []  # the turn end is not inside the prompt


def test_a_new_snapshot_replaces_the_old_one_per_replica():
    idx, snaps = _index()
    _apply(snaps, "a", [SESSION])
    _apply(snaps, "b", [SESSION])
    next_turn = SESSION + [7] * 30
    _apply(snaps, "a", [OTHER])  # a evicted the session; b still holds it
    assert _resume(idx, snaps, next_turn, "a") == (0, None)
    assert _resume(idx, snaps, next_turn, "b") == (len(SESSION), "device")
    _apply(snaps, "b", [])
    assert snaps.tail_probes(H, next_turn, H.block_hashes(next_turn)) == []
    assert _resume(idx, snaps, next_turn, "b") == (0, None)


def test_replica_report_credits_salted_sessions_up_to_their_turn_ends():
    """``deployments.servers.device_snapshot`` is what ``record_routing_stats`` sends; fed through
    ``DeviceSnapshots`` it credits each resident session (under its own salt) to its turn end."""
    from deployments.servers import device_snapshot

    aligned = OTHER[:2 * BS]
    blocks, tails = device_snapshot(H, [("tenant", SESSION), ("", aligned)])
    assert tails[0][0] == len(SESSION) and tails[1] is None  # an aligned turn end needs no tail
    assert blocks[1] == [h.hex() for h in H.block_hashes(aligned)]
    idx, snaps = _index()
    snaps.apply("a", blocks, tails)
    salted = H.with_salt("tenant")
    next_turn = SESSION + [7] * 30
    hashes = salted.block_hashes(next_turn)
    req = RouteRequest("r", "s", hashes, len(next_turn), BS, snaps.tail_probes(salted, next_turn, hashes))
    assert idx.resumable(req, "a") == (len(SESSION), "device")
    assert _resume(idx, snaps, next_turn, "a") == (0, None)  # unsalted digests name other content
    assert _resume(idx, snaps, aligned + [1] * 20, "a") == (len(aligned), "device")
