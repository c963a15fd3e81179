"""Simulator workloads: the request record, trace conversion, a synthetic generator.

A request names its prompt blocks by ``hash_ids`` (mooncake_trace style: equal
ids = identical token blocks). The simulator turns them into chained digests,
the same shape the router sees from real prompts:

    d_0 = H("sim-root" | salt)
    d_i = H(d_{i-1} | hash_ids[i-1])        for the full blocks only
    full blocks = input_length // block_size (a trailing partial block is never shared)

A trailing partial block gets a digest too (``chain_digests`` over all
``ceil(input_length / block_size)`` ids): it names the partial block's
content, so an unaligned resume point p (a prompt end) is named by
``tail_digest(d_{ceil(p / bs)}, p % bs)``. Salting (cache busting on a
replay) folds ``salt`` into every id not in the trace's shared set, as the
benchmark's token factory does, so the shared system prefix stays shared.

Synthetic agentic sessions (``synth_sessions``): every session starts with
the same system/tool prefix (global ids), then grows turn by turn; turn k+1
repeats turn k's full blocks and appends the previous output plus new
user/tool content, drawn so that consecutive-turn reuse is ~96%. The
benchmark's AgentX-style generator (``disagg.tools.bench.synth``) feeds the
simulator through ``from_trace_records``.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class SimRequest:
    session_id: str  # conversation id
    turn: int  # 0-based turn within the session
    delay_ms: float  # think time after the previous turn ended (closed loop)
    timestamp_ms: float  # arrival time (open loop)
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: list[int] = field(default_factory=list)  # one id per block (ceil)
    block_size: int = 256  # tokens per hash id
    parent_session: str | None = None  # subagent: its parent session

    def __post_init__(self) -> None:
        assert self.input_length > 0 and self.output_length > 0, "empty request"
        assert len(self.hash_ids) >= self.input_length // self.block_size, "too few hash ids"

    def __repr__(self) -> str:
        return (
            f"SimRequest(session_id={self.session_id!r}, turn={self.turn}, "
            f"input_length={self.input_length}, output_length={self.output_length})"
        )

    @property
    def num_full_blocks(self) -> int:
        return self.input_length // self.block_size


_ROOT = hashlib.sha256(b"sim-root|").digest()[:16]
_PACK = struct.Struct("<qq").pack


def chain_digests(hash_ids: list[int], num_blocks: int, salt: str = "") -> list[bytes]:
    h = hashlib.sha256(b"sim-root|" + salt.encode()).digest()[:16]
    out: list[bytes] = []
    for hid in hash_ids[:num_blocks]:
        h = hashlib.sha256(h + struct.pack("<q", hid)).digest()[:16]
        out.append(h)
    return out


def extend_digests(out: list[bytes], hash_ids: list[int], upto: int, salt: int = 0,
                   shared: frozenset[int] | set[int] = frozenset()) -> list[bytes]:
    """Extend the chain ``out`` (digests of ``hash_ids[:len(out)]``) to ``upto`` blocks.

    With ``salt == 0`` the chain is ``chain_digests``'s; otherwise every id not in
    ``shared`` is hashed together with the salt.
    """
    h = out[-1] if out else _ROOT
    sha = hashlib.sha256
    if salt == 0:
        for hid in hash_ids[len(out):upto]:
            h = sha(h + struct.pack("<q", hid)).digest()[:16]
            out.append(h)
        return out
    for hid in hash_ids[len(out):upto]:
        h = sha(h + _PACK(hid, 0 if hid in shared else salt)).digest()[:16]
        out.append(h)
    return out


def tail_digest(partial_block_digest: bytes, offset: int) -> bytes:
    """Name of the unaligned position ``offset`` tokens into the block named by ``partial_block_digest``."""
    return hashlib.sha256(b"tail|" + partial_block_digest + struct.pack("<q", offset)).digest()[:16]


class DigestCache:
    """Chained digests of each session's latest prompt, extended incrementally.

    Consecutive turns of a session share their leading ids, so only the ids
    after the common prefix are hashed (a turn of an agentic session hashes a
    few new blocks, not its whole context).
    """

    def __init__(self, shared: frozenset[int] | set[int] = frozenset()):
        self.shared = shared  # ids a salt leaves alone
        self._last: dict[tuple[str, int], tuple[list[int], list[bytes]]] = {}

    def digests(self, session_key: str, salt: int, hash_ids: list[int], num_blocks: int) -> list[bytes]:
        """Digests of ``hash_ids[:num_blocks]`` (a new list; callers may keep it)."""
        key = (session_key, salt)
        prev = self._last.get(key)
        if prev is None:
            out: list[bytes] = []
        else:
            ids, digs = prev
            n = min(len(digs), num_blocks)
            if ids[:n] != hash_ids[:n]:
                n = next(i for i, (a, b) in enumerate(zip(ids[:n], hash_ids[:n], strict=True)) if a != b)
            out = digs[:n]
        extend_digests(out, hash_ids, num_blocks, salt, self.shared)
        self._last[key] = (hash_ids, out)
        return out

    def forget(self, session_key: str, salt: int) -> None:
        self._last.pop((session_key, salt), None)


def from_mooncake_records(records: Iterable[dict], block_size: int = 512) -> list[SimRequest]:
    """Convert mooncake_trace-style dicts (session_id, turn, timestamp, delay, ...)."""
    out = []
    for i, r in enumerate(records):
        out.append(
            SimRequest(
                session_id=str(r.get("session_id", f"req{i}")),
                turn=int(r.get("turn", 0)),
                delay_ms=float(r.get("delay", 0.0) or 0.0),
                timestamp_ms=float(r.get("timestamp", 0.0) or 0.0),
                input_length=int(r["input_length"]),
                output_length=max(int(r.get("output_length", 1)), 1),
                hash_ids=[int(x) for x in r.get("hash_ids", [])],
                block_size=block_size,
            )
        )
    return out


def from_trace_records(records: Iterable, default_block_size: int = 512) -> list[SimRequest]:
    """Convert ``disagg.tools.bench.trace.TraceRecord``s (id lists are shared, not copied)."""
    return [
        SimRequest(r.session_id, r.turn, float(r.delay), float(r.timestamp), r.input_length,
                   max(r.output_length, 1), r.hash_ids,
                   r.block_size if r.block_size is not None else default_block_size, r.parent_session)
        for r in records
    ]


def shared_ids(requests: Iterable[SimRequest]) -> frozenset[int]:
    """Ids used by more than one session family (a session and its subagents): what a salt keeps."""
    families: dict[str, set[int]] = {}
    for r in requests:
        families.setdefault(r.parent_session or r.session_id, set()).update(r.hash_ids)
    counts: Counter[int] = Counter()
    for ids in families.values():
        counts.update(ids)
    return frozenset(h for h, n in counts.items() if n > 1)


def load_mooncake_jsonl(path: str, block_size: int = 512) -> list[SimRequest]:
    with open(path) as f:
        return from_mooncake_records((json.loads(line) for line in f if line.strip()), block_size)


@dataclass(slots=True)
class SynthConfig:
    num_sessions: int = 32  # sessions
    turns: int = 12  # turns per session (exact)
    block_size: int = 256  # tokens per block
    system_tokens: int = 4096  # shared system/tool prefix (rounded to blocks)
    first_user_tokens: int = 4096  # first user message, median
    new_tokens_frac: float = 0.03  # new user/tool tokens per turn, fraction of context
    output_median: int = 200  # output tokens, median (lognormal)
    output_max: int = 1024  # output cap
    think_s: float = 5.0  # think time mean (exponential)
    think_max_s: float = 30.0  # think time cap
    session_gap_s: float = 2.0  # open-loop spacing between session starts
    max_input: int = 131072  # context cap (a session ends before passing it)

    def __post_init__(self) -> None:
        if self.num_sessions <= 0 or self.turns <= 0 or self.block_size <= 0:
            raise ValueError("sessions, turns and block size must be positive")


def synth_sessions(cfg: SynthConfig | None = None, seed: int = 0) -> list[SimRequest]:
    """Seeded synthetic agentic sessions, sorted by (session, turn)."""
    cfg = cfg or SynthConfig()
    rng = random.Random(seed)
    bs = cfg.block_size
    sys_blocks = cfg.system_tokens // bs
    next_id = 1_000_000  # session-unique ids start here; 0.. are the shared prefix
    out: list[SimRequest] = []
    for s in range(cfg.num_sessions):
        sid = f"s{s:05d}"
        first = max(bs, int(rng.lognormvariate(math.log(cfg.first_user_tokens), 0.4)))
        length = sys_blocks * bs + first
        ids = list(range(sys_blocks))
        t_ms = s * cfg.session_gap_s * 1000.0
        prev_len = 0
        prev_ids: list[int] = []
        for turn in range(cfg.turns):
            if turn > 0:
                out_prev = out[-1].output_length
                new = max(64, int(rng.lognormvariate(math.log(cfg.new_tokens_frac * prev_len + 1), 0.5)))
                length = prev_len + out_prev + new
                if length > cfg.max_input:
                    break
                ids = prev_ids[: prev_len // bs]
            need = math.ceil(length / bs)
            while len(ids) < need:
                ids.append(next_id)
                next_id += 1
            out_len = min(cfg.output_max, max(1, int(rng.lognormvariate(math.log(cfg.output_median), 0.6))))
            delay = 0.0 if turn == 0 else min(rng.expovariate(1.0 / cfg.think_s), cfg.think_max_s) * 1000.0
            t_ms += delay + (0 if turn == 0 else 2000.0)
            out.append(SimRequest(sid, turn, delay, t_ms, length, out_len, list(ids), bs))
            prev_len, prev_ids = length, ids
    return out


def consecutive_reuse(requests: list[SimRequest]) -> float:
    """Mean over turns > 0 of (reused full blocks of the previous turn) / input."""
    by_session: dict[str, SimRequest] = {}
    ratios = []
    for r in sorted(requests, key=lambda r: (r.session_id, r.turn)):
        prev = by_session.get(r.session_id)
        if prev is not None:
            n = 0
            for a, b in zip(prev.hash_ids[: prev.num_full_blocks], r.hash_ids, strict=False):
                if a != b:
                    break
                n += 1
            ratios.append(n * r.block_size / r.input_length)
        by_session[r.session_id] = r
    return sum(ratios) / len(ratios) if ratios else 0.0
