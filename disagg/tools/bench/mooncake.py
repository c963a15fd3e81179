"""Import Mooncake-style traces (FAST'25 public traces, AIPerf ``mooncake_trace``).

Mooncake lines carry the core fields only::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}

with 512-token blocks and timestamps in ms. Missing fields are filled in:

- ``session_id``: kept when present; otherwise, by ``sessions=``

  - ``"each"``: every request is its own one-turn session;
  - ``"prefix"``: a request continues the session whose latest request's full
    blocks are a prefix of its own ``hash_ids`` (the longest such session
    wins; the previous last block may be partial, so it need not match).
    A match must cover at least ``min_match_blocks`` blocks, so requests that
    share only a global system prompt do not merge into one session.

- ``turn``: position within the (inferred) session.
- ``delay``: ``timestamp`` gap to the previous turn minus an estimate of that
  turn's service time (``est_ms_per_output_token`` x its output), floored at 0.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from disagg.tools.bench.trace import (
    TraceError,
    TraceRecord,
    check_session_order,
    iter_json_objects,
    num_blocks,
)

MOONCAKE_BLOCK_SIZE = 512
SessionMode = Literal["each", "prefix"]
TraceFormat = Literal["disagg", "mooncake"]


def trace_format(path: str | Path) -> TraceFormat:
    """Which format a JSONL trace is in, from its first object.

    ``disagg`` lines carry ``session_id`` and ``turn``; Mooncake lines carry
    ``input_length`` and ``hash_ids`` without them.

    Raises:
        TraceError: an empty file, a bad first line, or neither format.
    """
    src = str(path)
    for lineno, obj in iter_json_objects(path):
        if "session_id" in obj and "turn" in obj:
            return "disagg"
        if "input_length" in obj and "hash_ids" in obj:
            return "mooncake"
        raise TraceError(
            "neither a disagg trace line (session_id, turn, ...) nor a Mooncake line"
            " (timestamp, input_length, output_length, hash_ids)",
            line=lineno,
            source=src,
        )
    raise TraceError("trace is empty", source=src)


def _field_int(obj: dict[str, Any], key: str, lineno: int, src: str, minimum: int = 0) -> int:
    if key not in obj:
        raise TraceError("missing required field", line=lineno, field_name=key, source=src)
    value = obj[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(
            f"expected an integer >= {minimum}, got {value!r}",
            line=lineno,
            field_name=key,
            source=src,
        )
    return value


class _PrefixSessions:
    """Index of each session's latest request, keyed by its last full block id."""

    def __init__(self, min_match_blocks: int) -> None:
        self.min_match_blocks = min_match_blocks
        self.latest: dict[str, list[int]] = {}  # session -> latest request's full-block ids
        self.by_tail: dict[tuple[int, int], set[str]] = {}  # (num full blocks, last id) -> sessions

    def match(self, hash_ids: list[int]) -> str | None:
        for n in range(len(hash_ids), self.min_match_blocks - 1, -1):
            if n == 0:
                break
            for session in self.by_tail.get((n, hash_ids[n - 1]), ()):
                if self.latest[session] == hash_ids[:n]:
                    return session
        return None

    def update(self, session: str, hash_ids: list[int], input_length: int, block_size: int) -> None:
        old = self.latest.get(session)
        if old:
            self.by_tail[(len(old), old[-1])].discard(session)
        full = hash_ids[: input_length // block_size]
        self.latest[session] = full
        if full:
            self.by_tail.setdefault((len(full), full[-1]), set()).add(session)


def import_mooncake(
    path: str | Path,
    *,
    sessions: SessionMode = "prefix",
    block_size: int = MOONCAKE_BLOCK_SIZE,
    min_match_blocks: int = 2,
    est_ms_per_output_token: float = 20.0,
) -> list[TraceRecord]:
    """Read a Mooncake-style JSONL trace into validated :class:`TraceRecord` s.

    Args:
        path: the JSONL file.
        sessions: how to assign sessions when a line has no ``session_id``.
        block_size: tokens per hash block (512 for Mooncake's traces).
        min_match_blocks: shortest prefix (in blocks) that continues a session.
        est_ms_per_output_token: service-time estimate used to derive ``delay``.

    Returns:
        Records sorted by timestamp, one session per inferred conversation.

    Raises:
        TraceError: naming the line and field of the first bad line.
    """
    if sessions not in ("each", "prefix"):
        raise ValueError(f"sessions must be 'each' or 'prefix', got {sessions!r}")
    src = str(path)
    rows = list(iter_json_objects(path))
    if not rows:
        raise TraceError("trace is empty", source=src)
    parsed = []
    for lineno, obj in rows:
        ts = obj.get("timestamp", 0)
        if (isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts)
                or ts < 0):
            raise TraceError(
                f"expected a finite number >= 0, got {ts!r}",
                line=lineno,
                field_name="timestamp",
                source=src,
            )
        inp = _field_int(obj, "input_length", lineno, src, 1)
        out = _field_int(obj, "output_length", lineno, src, 1)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
            raise TraceError(
                "expected a list of non-negative integers",
                line=lineno,
                field_name="hash_ids",
                source=src,
            )
        bs = block_size if obj.get("block_size") is None else _field_int(obj, "block_size", lineno, src, 1)
        if len(ids) != num_blocks(inp, bs):
            raise TraceError(
                f"has {len(ids)} ids but ceil(input_length {inp} / block_size {bs})"
                f" = {num_blocks(inp, bs)}",
                line=lineno,
                field_name="hash_ids",
                source=src,
            )
        parsed.append((float(ts), lineno, obj, inp, out, ids, bs))
    parsed.sort(key=lambda row: (row[0], row[1]))

    index = _PrefixSessions(min_match_blocks)
    turns: dict[str, int] = {}
    last: dict[str, tuple[float, int]] = {}  # session -> (timestamp, output_length)
    records: list[TraceRecord] = []
    for ts, lineno, obj, inp, out, ids, bs in parsed:
        if obj.get("session_id") is not None:
            session = str(obj["session_id"])
        elif sessions == "prefix":
            session = index.match(ids) or f"mc{lineno:06d}"
        else:
            session = f"mc{lineno:06d}"
        turn = turns.get(session, -1) + 1
        turns[session] = turn
        if "delay" in obj:
            delay = float(obj["delay"])
        elif session in last:
            prev_ts, prev_out = last[session]
            delay = max(0.0, ts - prev_ts - prev_out * est_ms_per_output_token)
        else:
            delay = 0.0
        last[session] = (ts, out)
        index.update(session, ids, inp, bs)
        extras = {
            k: v
            for k, v in obj.items()
            if k
            not in (
                "timestamp",
                "input_length",
                "output_length",
                "hash_ids",
                "session_id",
                "delay",
                "block_size",
            )
        }
        records.append(TraceRecord(session, turn, ts, delay, inp, out, list(ids), None, bs, extras))
    check_session_order(records, source=src)
    return records
