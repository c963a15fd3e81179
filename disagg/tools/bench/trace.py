"""Agentic trace format: one request per JSONL line.

The format is a superset of the ``mooncake_trace`` JSONL used by AIPerf::

    {"session_id": "s0007", "turn": 3, "timestamp": 41250, "delay": 8000,
     "input_length": 21342, "output_length": 219, "hash_ids": [0, 1, 2, 333]}

``hash_ids`` cover the whole prompt, one id per block of ``block_size`` tokens;
equal ids mean identical token blocks, which is how prefix sharing is
reproduced with synthetic tokens. The last block may be partial::

    input_length = 1100, block_size = 512
    tokens  |<----- 512 ----->|<----- 512 ----->|<- 76 ->|
    hash_ids        h0                 h1           h2      (len = ceil(1100/512) = 3)

Optional fields: ``parent_session`` (a subagent's parent session id),
``block_size`` (per record; the file default is 512, Mooncake's) and
``extras`` (any other keys, kept verbatim).

Loading validates every line and raises :class:`TraceError` naming the file,
the line number and the offending field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_BLOCK_SIZE = 512

_REQUIRED: tuple[str, ...] = (
    "session_id",
    "turn",
    "timestamp",
    "delay",
    "input_length",
    "output_length",
    "hash_ids",
)
_OPTIONAL: tuple[str, ...] = ("parent_session", "block_size", "extras")


class TraceError(ValueError):
    """A malformed trace line; the message names the line and the field."""

    def __init__(
        self,
        message: str,
        *,
        line: int | None = None,
        field_name: str | None = None,
        source: str | None = None,
    ) -> None:
        where = []
        if source:
            where.append(str(source))
        if line is not None:
            where.append(f"line {line}")
        if field_name:
            where.append(f"field '{field_name}'")
        prefix = ", ".join(where) + ": " if where else ""
        super().__init__(prefix + message)
        self.line = line
        self.field_name = field_name
        self.source = source


@dataclass(slots=True)
class TraceRecord:
    """One request of a replayed session.

    NOTE 1: ``len(hash_ids) == ceil(input_length / block_size)``.
    NOTE 2: within a session, ``turn`` strictly increases with ``timestamp``.
    """

    session_id: str  # session this request belongs to (a lane replays it turn by turn)
    turn: int  # 0-based turn index within the session
    timestamp: float  # ms since trace start (open-loop send time)
    delay: float  # ms of think time after the previous turn ended (closed loop)
    input_length: int  # prompt tokens
    output_length: int  # tokens to generate (max_tokens, ignore_eos)
    hash_ids: list[int] = field(default_factory=list)  # one id per prompt block
    parent_session: str | None = None  # parent session id for subagents
    block_size: int | None = None  # tokens per hash block; None -> file default
    extras: dict[str, Any] = field(default_factory=dict)  # unknown keys, kept verbatim

    def __repr__(self) -> str:  # keep long id lists out of logs
        return (
            f"TraceRecord(session_id={self.session_id!r}, turn={self.turn}, "
            f"timestamp={self.timestamp:.0f}, input_length={self.input_length}, "
            f"output_length={self.output_length}, num_blocks={len(self.hash_ids)})"
        )

    def effective_block_size(self, default: int = DEFAULT_BLOCK_SIZE) -> int:
        return self.block_size if self.block_size is not None else default

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "session_id": self.session_id,
            "turn": self.turn,
            "timestamp": _compact_number(self.timestamp),
            "delay": _compact_number(self.delay),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": self.hash_ids,
        }
        if self.parent_session is not None:
            out["parent_session"] = self.parent_session
        if self.block_size is not None:
            out["block_size"] = self.block_size
        if self.extras:
            out["extras"] = self.extras
        return out


def _compact_number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else round(float(x), 3)


def num_blocks(input_length: int, block_size: int) -> int:
    return math.ceil(input_length / block_size)


def _check_int(
    obj: dict[str, Any], key: str, minimum: int, line: int | None, src: str | None
) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TraceError(
                f"expected an integer, got {value!r}", line=line, field_name=key, source=src
            )
    if value < minimum:
        raise TraceError(
            f"must be >= {minimum}, got {value}", line=line, field_name=key, source=src
        )
    return value


def _check_number(obj: dict[str, Any], key: str, line: int | None, src: str | None) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(
            f"expected a finite number, got {value!r}", line=line, field_name=key, source=src
        )
    if value < 0:
        raise TraceError(f"must be >= 0, got {value}", line=line, field_name=key, source=src)
    return float(value)


def record_from_dict(
    obj: Any,
    *,
    line: int | None = None,
    source: str | None = None,
    default_block_size: int = DEFAULT_BLOCK_SIZE,
) -> TraceRecord:
    """Validate one decoded JSON object and build a :class:`TraceRecord`."""
    if not isinstance(obj, dict):
        raise TraceError(
            f"expected a JSON object, got {type(obj).__name__}", line=line, source=source
        )
    for key in _REQUIRED:
        if key not in obj:
            raise TraceError("missing required field", line=line, field_name=key, source=source)
    session_id = obj["session_id"]
    if isinstance(session_id, int) and not isinstance(session_id, bool):
        session_id = str(session_id)
    if not isinstance(session_id, str) or not session_id:
        raise TraceError(
            f"expected a non-empty string, got {session_id!r}",
            line=line,
            field_name="session_id",
            source=source,
        )
    turn = _check_int(obj, "turn", 0, line, source)
    timestamp = _check_number(obj, "timestamp", line, source)
    delay = _check_number(obj, "delay", line, source)
    input_length = _check_int(obj, "input_length", 1, line, source)
    output_length = _check_int(obj, "output_length", 1, line, source)
    block_size = None
    if obj.get("block_size") is not None:
        block_size = _check_int(obj, "block_size", 1, line, source)
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise TraceError(
            "expected a list of non-negative integers",
            line=line,
            field_name="hash_ids",
            source=source,
        )
    bs = block_size if block_size is not None else default_block_size
    expected = num_blocks(input_length, bs)
    if len(hash_ids) != expected:
        raise TraceError(
            f"has {len(hash_ids)} ids but ceil(input_length {input_length} / block_size {bs})"
            f" = {expected}",
            line=line,
            field_name="hash_ids",
            source=source,
        )
    parent = obj.get("parent_session")
    if parent is not None and not isinstance(parent, str):
        raise TraceError(
            f"expected a string or null, got {parent!r}",
            line=line,
            field_name="parent_session",
            source=source,
        )
    extras = dict(obj.get("extras") or {})
    if not isinstance(extras, dict):
        raise TraceError("expected an object", line=line, field_name="extras", source=source)
    for key, value in obj.items():
        if key not in _REQUIRED and key not in _OPTIONAL:
            extras[key] = value
    return TraceRecord(
        session_id,
        turn,
        timestamp,
        delay,
        input_length,
        output_length,
        list(hash_ids),
        parent,
        block_size,
        extras,
    )


def iter_json_objects(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file; TraceError on a bad line."""
    src = str(path)
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark some editors write is not JSON
        for lineno, text in enumerate(f, start=1):
            text = text.strip()
            if not text:
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(
                    f"invalid JSON ({exc.msg} at column {exc.colno})", line=lineno, source=src
                ) from None
            if not isinstance(obj, dict):
                raise TraceError("expected a JSON object", line=lineno, source=src)
            yield lineno, obj


def iter_trace(
    path: str | Path, *, default_block_size: int = DEFAULT_BLOCK_SIZE
) -> Iterator[TraceRecord]:
    """Yield validated records of a JSONL trace; blank lines are skipped."""
    src = str(path)
    for lineno, obj in iter_json_objects(path):
        yield record_from_dict(obj, line=lineno, source=src, default_block_size=default_block_size)


def load_trace(
    path: str | Path, *, default_block_size: int = DEFAULT_BLOCK_SIZE, check_sessions: bool = True
) -> list[TraceRecord]:
    """Load and validate a trace file.

    Raises:
        TraceError: on the first bad line, or (``check_sessions``) when a
            session's turns are not strictly increasing in file order.
    """
    records = list(iter_trace(path, default_block_size=default_block_size))
    if not records:
        raise TraceError("trace is empty", source=str(path))
    if check_sessions:
        check_session_order(records, source=str(path))
    return records


def check_session_order(records: Iterable[TraceRecord], source: str | None = None) -> None:
    """Turns of each session must strictly increase in file order."""
    last_turn: dict[str, int] = {}
    for index, rec in enumerate(records, start=1):
        prev = last_turn.get(rec.session_id)
        if prev is not None and rec.turn <= prev:
            raise TraceError(
                f"turn {rec.turn} of session {rec.session_id!r} follows turn {prev}",
                line=index,
                field_name="turn",
                source=source,
            )
        last_turn[rec.session_id] = rec.turn


def save_trace(records: Iterable[TraceRecord], path: str | Path) -> int:
    """Write records as JSONL; returns the number of lines written."""
    count = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec.to_dict(), separators=(",", ":")))
            f.write("\n")
            count += 1
    return count


def group_sessions(records: Iterable[TraceRecord]) -> dict[str, list[TraceRecord]]:
    """Sessions in order of first appearance, each sorted by turn."""
    sessions: dict[str, list[TraceRecord]] = {}
    for rec in records:
        sessions.setdefault(rec.session_id, []).append(rec)
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn)
    return sessions
