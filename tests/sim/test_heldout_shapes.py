"""``benchmarks/heldout_shapes.py``: the held-out traces and the verdict printed for them.

Every shape of the three sets is written (small copies: a few sessions each) and
loaded by the trace reader ``disagg sim run --trace`` uses; the sessions must
have the shape's structure (a shared prompt first, turns that extend their
predecessor, contexts within the cap). Then the set names, the verdict's rule,
and one small trace through the script, against the same runs made directly.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import pytest

from disagg.tools.bench.trace import load_trace
from tests.sim.test_pd_itl_oracle import BENCH


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import heldout_shapes

    return heldout_shapes


def _rows_by_session(path: Path) -> dict[str, list[dict]]:
    by_session: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        r = json.loads(line)
        by_session[r["session_id"]].append(r)
    return by_session


def test_sets_name_every_shape_once(held) -> None:
    sets = [set(held.SETS[k]) for k in ("first", "second", "third", "fourth", "fifth")]
    assert set.union(*sets) == set(held.SHAPES)
    assert sum(map(len, sets)) == len(set.union(*sets))  # disjoint
    assert set(held.SETS["all"]) == set.union(*sets[:3])  # the earlier rounds' cells: the later sets apart
    assert held.shape_names("third") == ["reason", "nest", "rag", "stampede"]
    assert held.shape_names("first") == ["issue", "docqa", "groups", "longdoc"]
    assert held.shape_names("rush,second, issue") == ["rush", "toolloop", "mega", "swarm", "slowthink", "issue"]
    assert held.shape_names("all") == list(held.SETS["all"])


@pytest.mark.parametrize("name", ["issue", "groups", "toolloop", "mega", "swarm", "slowthink", "rush", "reason", "nest",
                                  "rag", "stampede", "chat", "fanwide", "tinyctx", "hugeshared", "waves",
                                  "heavytail"])
def test_trace_has_the_shapes_structure(held, tmp_path: Path, name: str) -> None:
    shape = dataclasses.replace(held.SHAPES[name], sessions=6)
    path = tmp_path / f"{name}.jsonl"
    n = held.write_trace(shape, path)
    recs = load_trace(str(path), default_block_size=held.BLOCK)
    assert len(recs) == n > 0
    by_session = _rows_by_session(path)
    parents = [s for s in by_session if "-sub" not in s]
    assert len(parents) == shape.sessions
    shared_len = shape.shared // held.BLOCK
    firsts = {tuple(by_session[s][0]["hash_ids"][:shared_len]) for s in parents}
    assert len(firsts) <= shape.groups  # every session opens with one of the shared prompts
    for sid, turns in by_session.items():
        assert [t["turn"] for t in turns] == list(range(len(turns)))
        for a, b in zip(turns, turns[1:], strict=False):
            assert b["hash_ids"][:len(a["hash_ids"])] == a["hash_ids"]  # a turn extends the one before
            assert shape.think_ms[0] <= b["delay"] <= shape.think_ms[1]
        for t in turns:
            assert t["input_length"] == len(t["hash_ids"]) * held.BLOCK
            assert shape.output[0] <= t["output_length"] <= shape.output[1]
        if "-sub" not in sid:
            assert shape.turns[0] <= len(turns) or len(turns[-1]["hash_ids"]) * held.BLOCK > shape.max_context - \
                shape.growth[1] - shape.output[1] - held.BLOCK
            assert len(turns) <= max(shape.turns[1], shape.long_turns[1])  # heavytail: a few long ones
            assert all(len(t["hash_ids"]) * held.BLOCK <= shape.max_context for t in turns)
    if shape.subgroups:  # nested: each session opens with one of the team prompts under its shared prompt
        team_len = shared_len + shape.subshared // held.BLOCK
        teams = {tuple(by_session[s][0]["hash_ids"][:team_len]) for s in parents}
        assert len(teams) <= shape.groups * shape.subgroups and {t[:shared_len] for t in teams} == firsts
    subs = [s for s in by_session if "-sub" in s]
    if not shape.fanout:
        assert not subs
    elif shape.fanout >= 0.3:  # 6 sessions of 8+ turns: some turn fans out
        assert subs


def test_compact_restarts_a_context_past_its_limit(held, tmp_path: Path) -> None:
    """``compact``: a turn that would pass 64K of context starts over as the shared prompt and a
    2-6K summary no earlier turn had; the turns after it extend the new context, and the session
    goes on to its drawn number of turns."""
    shape = dataclasses.replace(held.SHAPES["compact"], sessions=8)
    path = tmp_path / "compact.jsonl"
    held.write_trace(shape, path)
    by_session = _rows_by_session(path)
    shared = shape.shared // held.BLOCK
    restarts = 0
    for turns in by_session.values():
        assert shape.turns[0] <= len(turns) <= shape.turns[1]  # compaction does not end a session
        seen: set[int] = set()
        for a, b in zip(turns, turns[1:], strict=False):
            seen.update(a["hash_ids"])
            if b["hash_ids"][:len(a["hash_ids"])] != a["hash_ids"]:  # compacted
                restarts += 1
                assert b["hash_ids"][:shared] == turns[0]["hash_ids"][:shared]
                summary = b["hash_ids"][shared:]
                assert not seen & set(summary)
                assert shape.compact[0] // held.BLOCK <= len(summary) <= shape.compact[1] // held.BLOCK
        assert all(len(t["hash_ids"]) * held.BLOCK <= shape.max_context for t in turns)
    assert restarts >= len(by_session)  # 30-50 turns growing 2-6K each: every session compacts


def test_third_sets_outputs_and_arrivals(held, tmp_path: Path) -> None:
    """``reason`` answers at length (lognormal median e^7.3, about 1.5K tokens); ``rag`` is one-turn
    requests with short answers; ``stampede`` starts every session at once; ``nest``'s sessions open
    with one of 16 team prompts."""
    def rows(name: str, **kw) -> list[dict]:
        path = tmp_path / f"{name}.jsonl"
        held.write_trace(dataclasses.replace(held.SHAPES[name], **kw), path)
        return [json.loads(line) for line in path.read_text().splitlines()]

    outs = sorted(r["output_length"] for r in rows("reason", sessions=40))
    assert 1000 < outs[len(outs) // 2] < 2500 and outs[-1] <= 8000
    rag = rows("rag", sessions=200)
    assert len(rag) == len({r["session_id"] for r in rag}) == 200 and all(r["turn"] == 0 for r in rag)
    assert sorted(r["output_length"] for r in rag)[100] < 300
    starts = [r["timestamp"] for r in rows("stampede", sessions=40) if r["turn"] == 0]
    assert max(starts) < 1000
    shape = held.SHAPES["nest"]
    cut = (shape.shared + shape.subshared) // held.BLOCK
    opens = {tuple(r["hash_ids"][:cut]) for r in rows("nest", sessions=60) if r["turn"] == 0}
    assert 8 < len(opens) <= 16  # sessions share team prompts, several under each shared prompt


def test_fifth_set_shapes(held, tmp_path: Path) -> None:
    """``waves`` starts sessions only inside its 3 s windows, 30 s apart; ``heavytail`` has a few
    sessions of 60+ turns among short ones; ``rewind``'s turns extend the one before or go back
    1-3 turns to an earlier prompt and add a new message; ``mixed`` holds its four tenants, sharing
    no block across them, every row in order of its session's start."""
    def write(name: str, **kw) -> dict[str, list[dict]]:
        path = tmp_path / f"{name}.jsonl"
        held.write_trace(dataclasses.replace(held.SHAPES[name], **kw), path)
        return _rows_by_session(path)

    on, off = held.SHAPES["waves"].waves
    starts = [t[0]["timestamp"] for t in write("waves", sessions=200).values()]
    assert all(s % (on + off) < on for s in starts) and max(starts) >= on + off  # two waves or more
    lengths = sorted(len(t) for t in write("heavytail", sessions=100).values())
    assert lengths[0] >= 2 and lengths[len(lengths) // 2] <= 5 and lengths[-1] >= 40
    back = 0
    for turns in write("rewind", sessions=12).values():
        assert held.SHAPES["rewind"].turns[0] <= len(turns)
        for k in range(1, len(turns)):
            ids, prev = turns[k]["hash_ids"], turns[k - 1]["hash_ids"]
            if ids[:len(prev)] == prev and len(ids) > len(prev):
                continue  # the turn extends the one before (as every turn of the other shapes)
            earlier = [t["hash_ids"] for t in turns[max(0, k - 3):k]]  # back 1-3 turns: one of their prompts
            assert any(ids[:len(e)] == e and len(ids) > len(e) for e in earlier), (k, len(ids))
            back += 1
    assert back > 0
    mix = held.SHAPES["mixed"]
    path = tmp_path / "mixed.jsonl"
    n = held.write_trace(dataclasses.replace(mix, parts=tuple(dataclasses.replace(p, sessions=max(1, p.sessions // 20))
                                                               for p in mix.parts)), path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == n and [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    tenants: dict[str, set[int]] = defaultdict(set)
    for r in rows:
        tenants[r["session_id"].split("-")[0]].update(r["hash_ids"])
    assert len(tenants) == len(mix.parts)
    blocks = list(tenants.values())
    assert all(not (a & b) for i, a in enumerate(blocks) for b in blocks[i + 1:])  # tenants share nothing
    assert len(load_trace(str(path), default_block_size=held.BLOCK)) == n


def _row(policy: str, ttft: float, inter: float, tps: float, hit: float = 1.0) -> dict:
    return {"policy": policy, "ttft_p50": ttft / 2, "ttft_p90": ttft, "interactivity_p90": inter,
            "tokens_per_s_per_gpu": tps, "hit_vs_bound": hit}


def test_verdict_needs_every_figure(held) -> None:
    base = [_row("round_robin", 2.0, 100.0, 1000.0), _row("dynamo_cost", 1.0, 110.0, 1100.0)]
    v = held.verdict([_row("state_aware", 1.0, 110.0, 1089.0), *base])
    assert v["pass"] and v["ttft_p90_best"] == "dynamo_cost" and v["tokens_per_s_per_gpu"] == pytest.approx(0.99)
    assert not held.verdict([_row("state_aware", 1.0, 110.0, 1088.0), *base])["pass"]  # more than 1% behind
    assert not held.verdict([_row("state_aware", 1.01, 120.0, 2000.0), *base])["pass"]
    assert not held.verdict([_row("state_aware", 0.5, 109.9, 2000.0), *base])["pass"]
    assert not held.verdict([_row("state_aware", 0.5, 120.0, 2000.0, hit=0.949), *base])["pass"]


def test_unknown_shape_is_refused(held, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        held.main(["--out", str(tmp_path), "--shapes", "nosuch"])


def test_script_reports_what_the_cli_measures(held, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = dataclasses.replace(held.SHAPES["rush"], sessions=12, turns=(2, 4))
    monkeypatch.setitem(held.SHAPES, "rush", small)
    assert held.main(["--out", str(tmp_path), "--shapes", "rush", "--modes", "pd"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = json.loads((tmp_path / "rush_pd.json").read_text())
    assert [r["policy"] for r in rows][0] == "state_aware" and len(rows) == 5
    direct = held.run(tmp_path / "rush.jsonl", "pd", [], 16)
    assert [r["tokens_per_s_per_gpu"] for r in direct] == [r["tokens_per_s_per_gpu"] for r in rows]
    assert summary["rush/pd"] == held.verdict(rows)


def test_seed_offset_writes_other_traces_of_the_shape(held, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = dataclasses.replace(held.SHAPES["rush"], sessions=8, turns=(2, 3))
    monkeypatch.setitem(held.SHAPES, "rush", small)
    assert held.main(["--out", str(tmp_path), "--shapes", "rush", "--modes", "agg"]) == 0
    assert held.main(["--out", str(tmp_path), "--shapes", "rush", "--modes", "agg", "--seed-offset", "7"]) == 0
    base, other = (tmp_path / "rush.jsonl").read_text(), (tmp_path / "rush+7.jsonl").read_text()
    assert base != other
    held.write_trace(dataclasses.replace(small, seed=small.seed + 7), tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_text() == other
    summary = json.loads((tmp_path / "summary.json").read_text())  # the second run adds its cell
    assert list(summary) == ["rush/agg", "rush+7/agg"]
    assert summary["rush/agg"] == held.verdict(json.loads((tmp_path / "rush_agg.json").read_text()))
    assert (tmp_path / "rush+7_agg.json").exists() and (tmp_path / "rush_agg.json").exists()


def test_jobs_run_cells_at_once_with_the_same_results(held, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("rush", "mega"):
        monkeypatch.setitem(held.SHAPES, name, dataclasses.replace(held.SHAPES[name], sessions=6, turns=(2, 3)))
    cli = ["--shapes", "rush,mega", "--modes", "agg,pd"]
    assert held.main(["--out", str(tmp_path / "one"), *cli]) == 0
    one = capsys.readouterr().out
    assert held.main(["--out", str(tmp_path / "two"), *cli, "--jobs", "3"]) == 0
    two = capsys.readouterr().out
    assert one == two  # the same runs, printed in the cells' order
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert list(summary) == ["rush/agg", "rush/pd", "mega/agg", "mega/pd"]
    assert summary == json.loads((tmp_path / "one" / "summary.json").read_text())
    with pytest.raises(SystemExit):
        held.main(["--out", str(tmp_path / "bad"), *cli, "--jobs", "0"])
