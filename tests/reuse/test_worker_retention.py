"""Retention through the serving path (in process, disaggregated, tiny model on CPU): a multi-turn
session's superseded private checkpoints are demoted in the host tier, exactly those, none on the
system prompt it shares; a rewind resumes token-exact through a demoted checkpoint."""

from __future__ import annotations

import asyncio

from disagg.api.metrics import ServingMetrics, merge_replica_stats
from kv_transfer.keys import ObjectKey
from tests.reuse.test_worker_reuse import BS, backend, ids, send, threads  # noqa: F401 - threads is a fixture

KEEP = 2


def _positions(tokens: list[int], hasher) -> dict[bytes, int]:
    """Prefix digest -> position, for every position of ``tokens``."""
    out: dict[bytes, int] = {}
    hashes = hasher.block_hashes(tokens)
    for k in range(len(tokens) // BS + 1):
        parent = hashes[k - 1] if k else hasher.root
        if k:
            out[parent] = k * BS
        block = tokens[k * BS : (k + 1) * BS][: BS - 1]
        for t, d in enumerate(hasher.tail_digests(parent, block), start=1):
            out[d] = k * BS + t
    return out


def _uninterrupted(prompt: list[int]) -> list[int]:
    """``prompt``'s tokens from a fresh backend that never stored anything (the reference)."""
    ref = backend()
    try:
        return asyncio.run(send(ref, "r", prompt, "x"))[0]
    finally:
        ref.shutdown()


async def _four_turns(b, system: list[int]):
    """s0 sends ``system`` first (shared from then on), then session s1 four turns on it, each
    prompt its conversation so far and a new message: (prompts, conversation, (last output, last
    chunk))."""
    await send(b, "s0", system + ids(300, 10), "s0")
    prompts, convo, out, last = [], system, [], None
    for turn in range(4):
        prompt = convo + ids(150 + 10 * turn, turn)
        out, last = await send(b, f"s1-{turn}", prompt, "s1")
        prompts.append(prompt)
        convo = prompt + out
    return prompts, convo, (out, last)


def test_a_session_demotes_exactly_its_superseded_private_checkpoints(threads):  # noqa: F811
    # 2 GiB (sparse; 32 slabs): room for every size class, so nothing is evicted in this test
    b = backend(engine={"resident_sessions": False}, transfer={"host": {"capacity_mb": 2048, "pin_memory": False,
                                                                        "keep_checkpoints": KEEP,
                                                                        "policy": "s3fifo"}})
    system = ids(5 * BS, 99)
    try:
        prompts, convo, _ = asyncio.run(_four_turns(b, system))
        turn3_starts = len(prompts[2]) + 3  # turn 2's conversation end: later points are turn 3's
        tier = b.store.tiers[0]
        demoted = tier._policy.demoted()  # s3fifo: its demoted queue (nothing was evicted)
        held = [ObjectKey.parse(k) for k in tier.keys()]
        hasher = b.decode.hasher
        at = _positions(convo, hasher)
        mine = sorted(at[k.digest] for k in held if k.kind == "kda" and k.digest in at)
        shared_end = 6 * BS  # s1's first prompt starts with s0's 5 blocks: points before block 6 are shared
        private = [p for p in mine if p >= shared_end]
        gone = sorted(at.get(ObjectKey.parse(k).digest, -1) for k in demoted if k.startswith("kda:"))
        tails = sorted(at.get(ObjectKey.parse(k).digest, -1) for k in demoted if k.startswith("tail:"))
        stats = b.decode.stats()

        # the rewind: back to turn 2's prompt, a new message; its checkpoint there was demoted
        rewind = prompts[1] + ids(100, 42)
        assert len(prompts[1]) in gone
        toks, last = asyncio.run(send(b, "s1-rewind", rewind, "s1"))
    finally:
        b.shutdown()
    assert any(p < shared_end for p in mine), "the shared prefix has checkpoints of its own"
    latest = [p for p in private if p >= turn3_starts]
    assert len(latest) >= KEEP  # the latest turn alone fills KEEP: every earlier private point goes
    # exactly s1's private points of turns 0-2: none on the shared system prompt, none of s0's
    # (a first turn keeps its points), none of the latest turn
    assert gone == [p for p in private if p < turn3_starts], (gone, private)
    assert tails == [p for p in gone if p % BS]  # an unaligned point's tail goes with it
    assert stats["worker"]["checkpoints_demoted"] == len(gone)
    assert stats["store"]["tier:host"]["num_demoted"] == len(demoted)
    assert stats["store"]["tier:host"]["num_evictions"] == 0
    metrics = ServingMetrics()  # /metrics: the tier's demoted objects, the flow's demoted points
    metrics.observe_stats(merge_replica_stats([dict(stats, role="decode")]))
    text = metrics.render()[0].decode()
    assert f'disagg_tier_demoted{{tier="host"}} {float(len(demoted))}' in text
    assert f'disagg_worker_events{{event="checkpoints_demoted",role="decode"}} {float(len(gone))}' in text
    assert last.num_cached_tokens == len(prompts[1]) and last.cached_source == "host"
    assert toks == _uninterrupted(rewind)


def _first_turn_demoted(first: list[int]) -> list[int]:
    """Positions of ``first``'s checkpoints its turn end demoted in the host tier (aggregated, the
    default retention)."""
    b = backend(engine={"resident_sessions": False}, deployment={"mode": "aggregated"},
                transfer={"host": {"capacity_mb": 2048, "pin_memory": False, "policy": "s3fifo"}})
    try:
        asyncio.run(send(b, "r1", first, "s1"))
        at = _positions(first, b.decode.hasher)
        return sorted(at[ObjectKey.parse(k).digest] for k in b.store.tiers[0]._policy.demoted()
                      if k.startswith("kda:"))
    finally:
        b.shutdown()


def test_a_first_turns_start_prior_points_are_demoted_and_still_read(threads):  # noqa: F811
    """Aggregated, one first turn of 20 full blocks: the start prior keeps checkpoints at 4 and 8
    blocks (16 is the back prior's), speculative, so with ``speculative_first`` its turn end demotes
    exactly those in the host tier, and no other point (by default, none). A demoted point is still
    read: a second session sharing the first 9 blocks resumes at 8 of them, token-exact."""
    first = ids(20 * BS + 10, 7)
    assert _first_turn_demoted(first) == []  # off by default: a first turn keeps its points in order
    b = backend(engine={"resident_sessions": False}, deployment={"mode": "aggregated"},
                transfer={"host": {"capacity_mb": 2048, "pin_memory": False, "policy": "s3fifo",
                                   "speculative_first": True}})
    other = first[: 9 * BS] + ids(100, 8)
    try:
        asyncio.run(send(b, "r1", first, "s1"))
        tier = b.store.tiers[0]
        at = _positions(first, b.decode.hasher)
        demoted = sorted(at[ObjectKey.parse(k).digest] for k in tier._policy.demoted() if k.startswith("kda:"))
        held = sorted(at[k.digest] for k in map(ObjectKey.parse, tier.keys()) if k.kind == "kda" and k.digest in at)
        stats = b.decode.stats()
        toks, last = asyncio.run(send(b, "r2", other, "s2"))
    finally:
        b.shutdown()
    assert demoted == [4 * BS, 8 * BS], (demoted, held)
    assert {4 * BS, 8 * BS, 16 * BS, 20 * BS, len(first)} <= set(held)  # every point is kept
    assert stats["worker"]["checkpoints_demoted"] == 2
    assert last.num_cached_tokens == 8 * BS
    assert toks == _uninterrupted(other)


def test_a_turn_limit_demotes_the_older_turns_and_a_resume_teaches_the_learner(threads):  # noqa: F811
    """``keep_turns: 1``: at each turn end the session's private points of its earlier turns are
    demoted, all of them, where keep_checkpoints (8) alone keeps some; the next turn resumes
    from the latest turn's end, token-exact. Under "auto" the same turns teach the learner: each
    later turn could resume from its previous turn's end, one turn back at most (age 0)."""
    system = ids(5 * BS, 99)

    def run(keep_turns):
        b = backend(engine={"resident_sessions": False},
                    transfer={"host": {"capacity_mb": 2048, "pin_memory": False, "policy": "s3fifo",
                                       "keep_turns": keep_turns}})
        try:
            prompts, convo, last = asyncio.run(_four_turns(b, system))
            at = _positions(convo, b.decode.hasher)
            gone = sorted(at.get(ObjectKey.parse(k).digest, -1) for k in b.store.tiers[0]._policy.demoted()
                          if k.startswith("kda:"))
            retention = b.decode.flow.reuse.retention
            return prompts, gone, last, retention
        finally:
            b.shutdown()

    prompts, gone, (toks, last), _ = run(1)
    assert gone and gone == sorted(set(gone))
    assert min(gone) >= 6 * BS and max(gone) < len(prompts[2]) + 3  # s1's own, of turns 0-2 only
    assert last.num_cached_tokens > len(prompts[2]) and last.cached_source == "host"  # turn 2's end
    assert toks == _uninterrupted(prompts[3])
    _, gone_default, _, _ = run(0)
    assert set(gone_default) < set(gone)  # keep_checkpoints 8 alone keeps some of the earlier turns'
    _, _, _, learned = run("auto")
    assert learned.ages.observed == 3 and learned.ages._age[0] > 2.9  # turns 1-3, each from its latest turn
    assert learned.turns() == 0  # fewer resumes than the learner needs: no limit yet

