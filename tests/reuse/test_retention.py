"""The retention policy (``disagg.reuse.retention``): exact points demoted, shared ones never."""

from __future__ import annotations

import pytest

from disagg.reuse.retention import PublishedPoint, ResumeAges, SessionCheckpoints, superseded
from kv_transfer.keys import BlockHasher, KeyExtras

BS = 16
H = BlockHasher(BS, KeyExtras("tiny"))


def pt(p: int, turn: str = "") -> PublishedPoint:
    return PublishedPoint(p, f"d{p}".encode(), f"a{p}".encode(), turn or f"t{p}")


@pytest.mark.parametrize(
    "positions,keep,shared,demoted,kept",
    [
        ([10, 20, 30], 2, set(), [10], [20, 30]),
        ([10, 20, 30], 3, set(), [], [10, 20, 30]),
        ([10, 20, 30, 40], 1, {b"a20"}, [10, 30], [40]),  # shared: in neither list
        ([10, 20, 30], 0, set(), [], [10, 20, 30]),  # off
        ([], 2, set(), [], []),
    ],
)
def test_superseded_keeps_the_newest_private_points(positions, keep, shared, demoted, kept) -> None:
    got = superseded([pt(p) for p in positions], keep, shared)
    assert [p.position for p in got.demote] == demoted
    assert [p.position for p in got.track] == kept


def test_the_latest_turn_never_supersedes_its_own_points() -> None:
    points = [pt(10, "a"), pt(20, "a"), pt(30, "b"), pt(40, "b"), pt(50, "b")]
    got = superseded(points, 1, set())
    assert [p.position for p in got.demote] == [10, 20]
    assert [p.position for p in got.track] == [30, 40, 50]
    assert superseded(points[:2], 1, set()).demote == ()  # a first turn keeps all its points


def _digest(tokens: list[int], p: int) -> bytes:
    return H.prefix_digest(tokens, p)


def _published(r: SessionCheckpoints, *args, **kwargs) -> list[bytes]:
    return [pt.digest for pt in r.published(*args, **kwargs)]


def test_each_superseded_point_once_oldest_first_and_a_republish_is_newest() -> None:
    toks = list(range(200))
    r = SessionCheckpoints(BS, keep=2)
    assert _published(r, "s", "t1", toks, H, [32, 40, 48]) == []  # one turn: nothing superseded
    assert _published(r, "s", "t2", toks, H, [64, 70]) == [_digest(toks, 32), _digest(toks, 40), _digest(toks, 48)]
    assert _published(r, "s", "t3", toks, H, [64]) == []  # 64 is newest again: 70 is kept with it
    assert _published(r, "s", "t4", toks, H, [96]) == [_digest(toks, 70)]
    assert _published(r, "other", "t5", toks, H, [96]) == []  # per session
    assert _published(r, "", "t6", toks, H, [1, 2, 3]) == [] and r.num_demoted == 4


def test_points_on_a_prefix_another_session_started_with_are_never_demoted() -> None:
    system = list(range(100, 148))  # 3 blocks
    toks = system + list(range(60))
    r = SessionCheckpoints(BS, keep=1)
    r.note_shared(H.block_hashes(toks), 3)
    # 16, 32, 48 (aligned on shared blocks) and 50 (its last full block is shared) are shared
    assert _published(r, "s", "t1", toks, H, [16, 32, 48, 50, 64, 80]) == []
    assert _published(r, "s", "t2", toks, H, [90]) == [_digest(toks, 64), _digest(toks, 80)]


def test_speculative_points_go_at_once_unless_shared_and_are_not_tracked() -> None:
    """A first turn's start-prior points (16, 32, 64 here) are demoted as they land, the shared one
    (16: on the system prompt's block) aside; they are not among the session's tracked points, so
    the next turns' superseded points are what they would be without them, each returned once."""
    system = list(range(100, 116))  # 1 block another session started with
    toks = system + list(range(120))
    r = SessionCheckpoints(BS, keep=1)
    r.note_shared(H.block_hashes(toks), 1)
    assert _published(r, "s", "t1", toks, H, [16, 32, 64, 100, 128], speculative=(16, 32, 64)) == \
        [_digest(toks, 32), _digest(toks, 64)]
    assert _published(r, "s", "t2", toks, H, [130]) == [_digest(toks, 100), _digest(toks, 128)]
    assert _published(r, "s", "t3", toks, H, [32], speculative=(32,)) == [_digest(toks, 32)]  # only its points
    assert r.num_demoted == 5
    assert _published(r, "", "t4", toks, H, [32], speculative=(32,)) == []  # no session: no retention
    off = SessionCheckpoints(BS, keep=0)
    assert _published(off, "s", "t1", toks, H, [32, 64], speculative=(32,)) == []


def test_off_and_bad_config() -> None:
    r = SessionCheckpoints(BS, keep=0)
    assert not r.enabled and _published(r, "s", "t", list(range(100)), H, [16, 32, 48]) == []
    with pytest.raises(ValueError):
        SessionCheckpoints(BS, keep=-1)


def test_a_turn_limit_demotes_every_point_of_the_older_turns() -> None:
    points = [pt(10, "a"), pt(20, "a"), pt(30, "b"), pt(40, "c"), pt(50, "c")]
    assert superseded(points, 8, set()).demote == ()  # keep 8 alone: nothing
    one = superseded(points, 8, set(), turns=1)
    assert [p.position for p in one.demote] == [10, 20, 30]
    assert [p.position for p in one.track] == [40, 50]
    assert [p.position for p in superseded(points, 8, set(), turns=2).demote] == [10, 20]
    assert superseded(points, 8, set(), turns=3).demote == ()
    assert [p.position for p in superseded(points, 2, set(), turns=2).demote] == [10, 20, 30]  # keep: as before
    assert superseded(points, 0, set(), turns=1).demote == ()  # retention off


def test_learned_turns_follow_how_far_back_resumes_reach() -> None:
    ages = ResumeAges(tail=0.05, min_resumes=20, half_life=50.0, cap=4)
    for _ in range(40):
        ages.observe(0, 3)
    assert ages.turns() == 1  # linear sessions: their latest turn only
    for i in range(40):
        ages.observe(1 if i % 4 == 0 else 0, 3)  # a quarter reach one turn back
    assert ages.turns() == 2
    for i in range(40):
        ages.observe(9 if i % 4 == 0 else 0, 12)  # ... then past the cap: no limit
    assert ages.turns() == 0
    for _ in range(400):  # the workload changed: the old ages decay away
        ages.observe(0, 12)
    assert ages.turns() == 1
    with pytest.raises(ValueError):
        ResumeAges(tail=0.0)


def test_no_limit_before_sessions_deeper_than_it_were_seen() -> None:
    """A limit of N turns is set only after ``min_resumes`` prompts of sessions that had more than
    N turns: early in a workload every session is young, and young sessions cannot show how far
    back the older ones will reach (Mooncake's synthetic trace lost hit to limits set then)."""
    ages = ResumeAges(tail=0.05, min_resumes=20, half_life=1e9, cap=4)
    for _ in range(100):
        ages.observe(0, 1)  # first-turn resumes (of shared prompts): nothing about age 1 or more
    assert ages.observed >= 20 and ages.turns() == 0
    for _ in range(19):
        ages.observe(0, 2)
    assert ages.turns() == 0  # 19 prompts of sessions with two turns
    ages.observe(0, 2)
    assert ages.turns() == 1
    for i in range(40):  # a third of the prompts of three-turn sessions reach back two turns ...
        ages.observe(2 if i % 3 == 0 else 0, 3)
    assert ages.turns() == 0  # ... so keep three, but no session had more than three turns yet
    for _ in range(20):
        ages.observe(0, 4)
    assert ages.turns() == 3


def test_young_sessions_do_not_hide_how_far_back_old_ones_reach() -> None:
    """Most prompts come from sessions of one or two turns, which can only resume from their latest
    turn; a tenth of the prompts of sessions with three or more turns reach two turns back. Among
    all prompts that is 2%, under a 5% tail; among those that could, 10%: keep three turns (the
    sessions had four, so the limit demotes their first)."""
    ages = ResumeAges(tail=0.05, min_resumes=20, half_life=1e9, cap=4)
    for i in range(400):
        ages.observe(0, 1 + i % 2)
    for i in range(100):
        ages.observe(2 if i % 10 == 0 else 0, 4)
    assert ages.turns() == 3


def _linear(r: SessionCheckpoints, session: str, turns: int, resumes: str = "latest") -> list[list[bytes]]:
    """``turns`` turns of a session whose prompts grow by 40 tokens; each turn first resumes (learned
    by ``wanted``) from its previous turn's end (``latest``) or from its first turn's (``first``),
    then publishes its prompt's points. Returns what each publish demoted."""
    toks = list(range(1000))
    out = []
    for t in range(turns):
        end = 40 * (t + 1)
        if t:
            want = 40 * t if resumes == "latest" else 40
            r.wanted(session, _digest(toks, want))
        out.append(_published(r, session, f"{session}-{t}", toks[:end], H, [end - 8, end]))
    return out


def test_auto_turns_demote_the_older_turns_of_linear_sessions() -> None:
    r = SessionCheckpoints(BS, keep=8, keep_turns="auto")
    r.ages = ResumeAges(min_resumes=4)
    for s in range(4):
        _linear(r, f"s{s}", 3)  # 8 resumes, 4 of sessions with two turns, each from its latest turn:
    #                             limit 1 from now on
    assert r.turns() == 1
    demoted = _linear(r, "late", 3)
    toks = list(range(1000))
    assert demoted[0] == [] and demoted[1] == [_digest(toks, 32), _digest(toks, 40)]
    assert demoted[2] == [_digest(toks, 72), _digest(toks, 80)]


def test_auto_turns_keep_older_turns_where_resumes_reach_them() -> None:
    r = SessionCheckpoints(BS, keep=8, keep_turns="auto")
    r.ages = ResumeAges(min_resumes=8)
    for s in range(3):  # every later turn resumes from the first turn's end: up to 3 turns back,
        _linear(r, f"s{s}", 5, resumes="first")  # as far as these sessions go: no limit
    assert r.turns() == 0
    assert all(d == [] for d in _linear(r, "late", 4, resumes="first"))
    fixed = SessionCheckpoints(BS, keep=8, keep_turns=1)
    assert fixed.ages is None and fixed.turns() == 1
    with pytest.raises(ValueError):
        SessionCheckpoints(BS, keep=8, keep_turns=-1)
    with pytest.raises(ValueError):
        SessionCheckpoints(BS, keep=8, keep_turns="always")
