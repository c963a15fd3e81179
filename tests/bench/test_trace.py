"""Trace format: round trip, schema errors with line numbers, Mooncake import."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.tools.bench.mooncake import import_mooncake
from disagg.tools.bench.trace import TraceError, TraceRecord, load_trace, save_trace


def _line(**over: object) -> dict:
    base = {
        "session_id": "s0",
        "turn": 0,
        "timestamp": 0,
        "delay": 0,
        "input_length": 1100,
        "output_length": 10,
        "hash_ids": [0, 1, 2],
    }
    base.update(over)
    return base


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    recs = [
        TraceRecord("s0", 0, 0.0, 0.0, 100, 5, [0, 1], block_size=64),
        TraceRecord(
            "s0.sub0",
            0,
            12.5,
            0.0,
            64,
            2,
            [0],
            parent_session="s0",
            block_size=64,
            extras={"tool": "grep"},
        ),
    ]
    save_trace(recs, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == recs


def test_unknown_keys_go_to_extras(tmp_path: Path) -> None:
    (rec,) = load_trace(_write(tmp_path / "t.jsonl", [_line(model="k3")]))
    assert rec.extras == {"model": "k3"} and rec.block_size is None


@pytest.mark.parametrize(
    ("row", "field", "words"),
    [
        (_line(hash_ids=[0, 1]), "hash_ids", "ceil(input_length 1100 / block_size 512) = 3"),
        ({k: v for k, v in _line().items() if k != "delay"}, "delay", "missing required field"),
        (_line(input_length="12"), "input_length", "expected an integer"),
        (_line(turn=True), "turn", "expected an integer"),
        (_line(timestamp=-1), "timestamp", "must be >= 0"),
        (_line(output_length=0), "output_length", "must be >= 1"),
        (_line(hash_ids=[0, -1, 2]), "hash_ids", "non-negative integers"),
        (_line(session_id=""), "session_id", "non-empty string"),
        (_line(block_size=0), "block_size", "must be >= 1"),
        (_line(parent_session=3), "parent_session", "expected a string"),
    ],
)
def test_bad_line_names_line_and_field(tmp_path: Path, row: dict, field: str, words: str) -> None:
    path = _write(tmp_path / "t.jsonl", [_line(), "", row])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    msg = str(info.value)
    assert "line 3" in msg and f"field '{field}'" in msg and words in msg, msg
    assert info.value.line == 3 and info.value.field_name == field


def test_invalid_json_and_non_object(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"line 2: invalid JSON"):
        load_trace(_write(tmp_path / "a.jsonl", [_line(), '{"session_id": ']))
    with pytest.raises(TraceError, match=r"line 1: expected a JSON object"):
        load_trace(_write(tmp_path / "b.jsonl", ["[1, 2]"]))
    with pytest.raises(TraceError, match="empty"):
        load_trace(_write(tmp_path / "c.jsonl", [""]))


def test_turns_must_increase_within_a_session(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [_line(turn=1), _line(session_id="s1"), _line(turn=1)])
    with pytest.raises(
        TraceError, match=r"line 3, field 'turn': turn 1 of session 's0' follows turn 1"
    ):
        load_trace(path)


def test_block_size_per_record(tmp_path: Path) -> None:
    (rec,) = load_trace(
        _write(tmp_path / "t.jsonl", [_line(block_size=100, hash_ids=list(range(11)))])
    )
    assert rec.block_size == 100 and len(rec.hash_ids) == 11


def _mc(ts: int, inp: int, out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids}


def test_mooncake_sessions_inferred_by_prefix(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "m.jsonl",
        [
            _mc(0, 1100, 50, [1, 2, 3]),  # conversation A, turn 0 (last block partial)
            _mc(100, 1024, 5, [10, 11]),  # conversation B
            _mc(5000, 1600, 7, [1, 2, 3, 4]),  # A continues: its full blocks [1, 2] are a prefix
            _mc(6000, 600, 3, [1, 9]),  # shares one block only: a new session
            _mc(7000, 1536, 3, [10, 11, 12]),  # B continues
        ],
    )
    recs = import_mooncake(path)
    by = {(r.timestamp, r.session_id, r.turn) for r in recs}
    a, b = recs[0].session_id, recs[1].session_id
    assert (5000.0, a, 1) in by and (7000.0, b, 1) in by
    assert len({r.session_id for r in recs}) == 3
    assert all(r.block_size == 512 for r in recs)
    a1 = next(r for r in recs if r.session_id == a and r.turn == 1)
    assert a1.delay == 5000 - 0 - 50 * 20.0  # gap minus estimated service time
    assert len({r.session_id for r in import_mooncake(path, sessions="each")}) == 5


def test_mooncake_keeps_given_sessions_and_reports_bad_lines(tmp_path: Path) -> None:
    ok = _write(tmp_path / "ok.jsonl", [{**_mc(0, 10, 1, [5]), "session_id": "x", "delay": 7}])
    (rec,) = import_mooncake(ok)
    assert rec.session_id == "x" and rec.delay == 7
    bad = _write(
        tmp_path / "bad.jsonl",
        [_mc(0, 10, 1, [5]), {"timestamp": 1, "output_length": 1, "hash_ids": [1]}],
    )
    with pytest.raises(TraceError, match=r"line 2, field 'input_length': missing"):
        import_mooncake(bad)
    wrong = _write(tmp_path / "w.jsonl", [_mc(0, 1025, 1, [5, 6])])
    with pytest.raises(TraceError, match=r"line 1, field 'hash_ids'"):
        import_mooncake(wrong)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [5]}', "timestamp"),
        ('{"timestamp": Infinity, "input_length": 10, "output_length": 1, "hash_ids": [5]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [5], "block_size": "x"}',
         "block_size"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [5], "block_size": -4}',
         "block_size"),
    ],
)
def test_mooncake_rejects_values_json_allows_but_a_trace_cannot_mean(
    tmp_path: Path, line: str, field: str
) -> None:
    """Python's json reads NaN and Infinity; a timestamp of either once ran as a real one."""
    path = tmp_path / "m.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=rf"line 1, field '{field}'"):
        import_mooncake(path)


def test_a_byte_order_mark_before_the_first_line_is_read_past(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_text("\ufeff" + json.dumps(_mc(0, 1024, 3, [1, 2])) + "\n", encoding="utf-8")
    (rec,) = import_mooncake(path)
    assert rec.input_length == 1024 and rec.hash_ids == [1, 2]
