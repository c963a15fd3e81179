"""Held-out trace shapes: agentic traces no router default was tuned on, run as a new user would.

The router suite (``benchmarks/router_suite.py``) runs the trace family of
``disagg.tools.bench.family`` at a reduced scale with the suite's retention.
This script writes traces of other shapes with a generator of its own (not
the family's code), in the documented trace format, then replays each with
the plain CLI, every policy, at the CLI's defaults except the block size and
the cluster (``--workers``: 16 by default; P/D a quarter of them prefill)::

    disagg sim run --trace T --block-size 64 --policy all --workers 16 --json
    disagg sim run --trace T --block-size 64 --policy all --prefill 4 --decode 12 --json   (pd)
    disagg sim run --trace T --block-size 64 --policy all --prefill 16 --decode 48 --json  (pd, --workers 64)

Shapes (sessions, shared prompt, first turn, per-turn growth, turns, think time):

    issue     96, 12K, 2-16K, 0.5-6K, 12-36, 1-15 s; contexts to 128K (the issue's trace)
    docqa     96, 4K, 8-30K, 0.2-2K, 6-20, 0.5-4 s
    groups    160, three 20K prompts, 1-4K, 1-3K, 20-40, 3-30 s; 10% of turns fan out a
              3-turn subagent on the parent's shared prompt
    longdoc   64, 2K, 20-60K, 2-8K, 4-12, 2-8 s; outputs 100-2000

A second set, written after every router default of rounds 1-18 was fixed
and run before any change (``--shapes second``; ``--shapes all`` runs both):

    toolloop  200, 6K, 1-3K, 0.2-1.5K, 30-60, 0.2-2 s (tool-call loops: many short turns)
    mega      32, 30K, 40-90K, 2-10K, 4-10, 5-30 s; contexts to 200K
    swarm     120, two 16K prompts, 1-3K, 0.5-2K, 8-16, 1-6 s; 30% of turns fan out a subagent
    slowthink 96, 8K, 4-12K, 1-4K, 10-20, 20-90 s; sessions start 10 a second
    rush      256, 3K, 1-6K, 0.3-3K, 5-15, 0.5-3 s; sessions start 20 a second

A third set, written and first run with round 19's defaults, shapes neither
set had (``--shapes third``):

    reason    96, 6K, 2-8K, 0.3-2K, 4-12, 2-20 s; long answers (lognormal median 1.5K, 300-8K)
    nest      160, four 8K prompts each under four 4K team prompts (nested prefixes), 0.5-4K,
              0.5-3K, 6-20, 1-10 s; sessions start 5 a second
    rag       1200 one-turn requests on four 10K documents, 0.2-1.5K questions, short answers
              (median 150); requests start 33 a second
    stampede  128, 10K, 4-20K, 0.5-4K, 8-20, 1-8 s; every session starts in the first 0.3 s

A fourth set, written in round 35 before any change of that round and first run
with round 33's defaults (``--shapes fourth``; not in ``all``, whose cells the
earlier rounds' commands name):

    chat        400, 1K, 0.1-0.8K, 50-400, 3-10, 5-60 s; outputs 20-1500 (median ~250); sessions
                start 10 a second (plain chat: little to reuse, load decides)
    compact     64, 8K, 4-12K, 2-6K, 30-50, 1-10 s; past 64K of context the agent compacts it:
                the context restarts as the shared prompt and a 2-6K summary (a new prefix)
    fanwide     48, 24K, 1-4K, 0.5-2K, 6-14, 2-12 s; 60% of turns fan out a subagent
    tinyctx     300, 0.5K, 0.1-0.5K, 50-200, 10-30, 0.1-1 s; outputs 10-300; sessions start 50 a
                second (many tiny turns)
    hugeshared  96, 60K, 0.5-2K, 0.2-1K, 4-12, 2-10 s (a shared prompt dominates every prompt)

A fifth set, written in round 39 before any change of that round and first run
with round 38's defaults (``--shapes fifth``; not in ``all``): what one trace
of one shape never has.

    mixed       four tenants at once, sharing nothing: 160 chat sessions (as chat), 40 coding agents
                (12K, 2-16K, 0.5-6K, 12-30 turns, contexts to 128K), 400 RAG questions on three 10K
                documents, 24 reasoning sessions with long answers (as reason)
    rewind      96, 8K, 2-8K, 0.3-2K, 10-24, 2-20 s; a quarter of later turns first go back 1-3
                turns (a regenerated or edited answer: the session resumes an older turn)
    waves       240, 6K, 1-8K, 0.3-3K, 4-12, 1-8 s; sessions start 40 a second in 3 s waves, 30 s
                apart (load that comes and goes)
    heavytail   160, 10K, 1-6K, 0.5-4K, 2-5, 0.5-6 s; 6% of sessions run 60-100 turns, contexts to 160K
                (a few long sessions among many short ones)

Printed per shape: every policy's row, then the state-aware router's verdict
against the best baseline per figure (TTFT P90 and P90 interactivity as
ratios where > 1 is better; tok/s/GPU as a ratio; hit against the capacity
bound). Written: ``OUT/<shape>.jsonl`` (the trace), ``OUT/<shape>_<mode>.json``
(the rows; ``<shape>_<workers>_<mode>.json`` for sizes other than 16),
``OUT/summary.json`` (keys ``shape/mode``, or ``shape/workers/mode``; a run adds its cells to
those earlier runs into OUT left there, replacing the ones it ran again) and ``OUT/summary.png``
(this run's verdicts as bars, as the router suite draws them).

    python benchmarks/heldout_shapes.py --out results/heldout
    python benchmarks/heldout_shapes.py --out results/heldout --shapes issue,longdoc --modes agg,pd
    python benchmarks/heldout_shapes.py --out results/heldout --retention session
    python benchmarks/heldout_shapes.py --out results/heldout --modes agg,pd --workers 16,64
    python benchmarks/heldout_shapes.py --out results/heldout2 --shapes second --modes agg,pd --jobs 2
    python benchmarks/heldout_shapes.py --out results/heldout2 --shapes second --modes agg,pd --seed-offset 1000
    python benchmarks/heldout_shapes.py --out results/variant --shapes all --router-config CFG \
        --reuse-baselines results/heldout                    # the router alone, against stored baselines
    python benchmarks/heldout_shapes.py --out results/all --shapes all --modes agg,pd --jobs 16 --split-policies

``--split-policies`` runs each policy of a cell as a process of its own (``--policy P``, whose row
is the same as ``--policy all``'s but for its wall time), for a machine with more cores than
cells; each row is kept in ``OUT/rows/`` as it ends, and a run into the same OUT takes the rows
already there, so a run stopped part way goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from disagg.tools.sim.cli import POLICIES, keep_turns_arg
from disagg.tools.sim.simulator import HOST_POLICIES, HOST_WRITES, OUTPUT_HINTS, ROUTER_COSTS

BLOCK = 64


@dataclass(frozen=True)
class Shape:
    seed: int
    sessions: int = 96
    shared: int = 12000  # shared prompt tokens (per group)
    groups: int = 1  # distinct shared prompts
    first: tuple[int, int] = (2000, 16000)  # first turn's own tokens
    growth: tuple[int, int] = (500, 6000)  # new tokens per turn besides the previous output
    turns: tuple[int, int] = (12, 36)
    think_ms: tuple[int, int] = (1000, 15000)
    output: tuple[int, int] = (50, 900)  # clamp of a lognormal(output_mu, output_sigma) draw
    output_mu: float = 5.3
    output_sigma: float = 0.8
    subgroups: int = 0  # team prompts under each shared prompt (nested prefixes; 0: none) ...
    subshared: int = 4000  # ... of this many tokens each
    max_context: int = 128000
    arrival_ms: float = 400.0  # mean gap between session starts (open-loop timestamps)
    fanout: float = 0.0  # share of turns that start a 3-turn subagent on the shared prompt
    compact: tuple[int, int] = (0, 0)  # past max_context, the agent compacts: its context restarts as the
    #                                    shared prompt and a summary of this many tokens (0: the session ends)
    rewind: float = 0.0  # share of later turns that first go back 1-3 turns (a regenerated or edited answer)
    long: float = 0.0  # share of sessions that draw their turn count from long_turns (a heavy tail) ...
    long_turns: tuple[int, int] = (0, 0)
    waves: tuple[int, int] = (0, 0)  # sessions start only in on-windows of this many ms, then off (0: always)


@dataclass(frozen=True)
class Mix:
    """Tenants of other shapes in one trace: each part's sessions start from time 0 at the part's
    own ``arrival_ms``, and no block is shared across parts. One random stream, from ``seed``,
    draws every part (the parts' own seeds are not used)."""

    seed: int
    parts: tuple[Shape, ...]


SHAPES: dict[str, Shape | Mix] = {
    "issue": Shape(seed=11),
    "docqa": Shape(seed=12, shared=4000, first=(8000, 30000), growth=(200, 2000), turns=(6, 20),
                   think_ms=(500, 4000)),
    "groups": Shape(seed=13, sessions=160, shared=20000, groups=3, first=(1000, 4000), growth=(1000, 3000),
                    turns=(20, 40), think_ms=(3000, 30000), fanout=0.1),
    "longdoc": Shape(seed=14, sessions=64, shared=2000, first=(20000, 60000), growth=(2000, 8000), turns=(4, 12),
                     think_ms=(2000, 8000), output=(100, 2000)),
    "toolloop": Shape(seed=101, sessions=200, shared=6000, first=(1000, 3000), growth=(200, 1500), turns=(30, 60),
                      think_ms=(200, 2000)),
    "mega": Shape(seed=102, sessions=32, shared=30000, first=(40000, 90000), growth=(2000, 10000), turns=(4, 10),
                  think_ms=(5000, 30000), max_context=200000),
    "swarm": Shape(seed=103, sessions=120, shared=16000, groups=2, first=(1000, 3000), growth=(500, 2000),
                   turns=(8, 16), think_ms=(1000, 6000), fanout=0.3),
    "slowthink": Shape(seed=104, shared=8000, first=(4000, 12000), growth=(1000, 4000), turns=(10, 20),
                       think_ms=(20000, 90000), arrival_ms=100),
    "rush": Shape(seed=105, sessions=256, shared=3000, first=(1000, 6000), growth=(300, 3000), turns=(5, 15),
                  think_ms=(500, 3000), arrival_ms=50),
    "reason": Shape(seed=201, shared=6000, first=(2000, 8000), growth=(300, 2000), turns=(4, 12),
                    think_ms=(2000, 20000), output=(300, 8000), output_mu=7.3, output_sigma=0.7),
    "nest": Shape(seed=202, sessions=160, shared=8000, groups=4, subgroups=4, subshared=4000, first=(500, 4000),
                  growth=(500, 3000), turns=(6, 20), think_ms=(1000, 10000), arrival_ms=200),
    "rag": Shape(seed=203, sessions=1200, shared=10000, groups=4, first=(200, 1500), turns=(1, 1), think_ms=(0, 0),
                 output=(20, 600), output_mu=5.0, output_sigma=0.6, arrival_ms=30),
    "stampede": Shape(seed=204, sessions=128, shared=10000, first=(4000, 20000), growth=(500, 4000), turns=(8, 20),
                      think_ms=(1000, 8000), arrival_ms=2),
    "chat": Shape(seed=301, sessions=400, shared=1000, first=(100, 800), growth=(50, 400), turns=(3, 10),
                  think_ms=(5000, 60000), output=(20, 1500), output_mu=5.5, arrival_ms=100),
    "compact": Shape(seed=302, sessions=64, shared=8000, first=(4000, 12000), growth=(2000, 6000), turns=(30, 50),
                     think_ms=(1000, 10000), max_context=64000, compact=(2000, 6000)),
    "fanwide": Shape(seed=303, sessions=48, shared=24000, first=(1000, 4000), growth=(500, 2000), turns=(6, 14),
                     think_ms=(2000, 12000), fanout=0.6),
    "tinyctx": Shape(seed=304, sessions=300, shared=512, first=(100, 500), growth=(50, 200), turns=(10, 30),
                     think_ms=(100, 1000), output=(10, 300), output_mu=4.0, arrival_ms=20),
    "hugeshared": Shape(seed=305, sessions=96, shared=60000, first=(500, 2000), growth=(200, 1000), turns=(4, 12),
                        think_ms=(2000, 10000), max_context=200000),
}
# the fifth set (round 39), written before any change of that round
SHAPES |= {
    "mixed": Mix(seed=401, parts=(
        Shape(seed=0, sessions=160, shared=1000, first=(100, 800), growth=(50, 400), turns=(3, 10),
              think_ms=(5000, 60000), output=(20, 1500), output_mu=5.5, arrival_ms=150),  # chat
        Shape(seed=0, sessions=40, shared=12000, first=(2000, 16000), growth=(500, 6000), turns=(12, 30),
              think_ms=(1000, 15000), arrival_ms=600),  # coding agents, contexts to 128K
        Shape(seed=0, sessions=400, shared=10000, groups=3, first=(200, 1500), turns=(1, 1), think_ms=(0, 0),
              output=(20, 600), output_mu=5.0, output_sigma=0.6, arrival_ms=60),  # RAG on three documents
        Shape(seed=0, sessions=24, shared=6000, first=(2000, 8000), growth=(300, 2000), turns=(4, 10),
              think_ms=(2000, 20000), output=(300, 8000), output_mu=7.3, output_sigma=0.7, arrival_ms=1000),
    )),
    "rewind": Shape(seed=402, sessions=96, shared=8000, first=(2000, 8000), growth=(300, 2000), turns=(10, 24),
                    think_ms=(2000, 20000), rewind=0.25),
    "waves": Shape(seed=403, sessions=240, shared=6000, first=(1000, 8000), growth=(300, 3000), turns=(4, 12),
                   think_ms=(1000, 8000), arrival_ms=25, waves=(3000, 30000)),
    "heavytail": Shape(seed=404, sessions=160, shared=10000, first=(1000, 6000), growth=(500, 4000), turns=(2, 5),
                       think_ms=(500, 6000), long=0.06, long_turns=(60, 100), max_context=160000),
}
SETS: dict[str, tuple[str, ...]] = {
    "first": ("issue", "docqa", "groups", "longdoc"),
    "second": ("toolloop", "mega", "swarm", "slowthink", "rush"),
    "third": ("reason", "nest", "rag", "stampede"),
    "fourth": ("chat", "compact", "fanwide", "tinyctx", "hugeshared"),
    "fifth": ("mixed", "rewind", "waves", "heavytail"),
}
SETS["all"] = SETS["first"] + SETS["second"] + SETS["third"]  # the sets of rounds 9-33 (the later ones apart)


def shape_names(spec: str) -> list[str]:
    """``--shapes``: a comma list of shape names and set names (SETS), in order, each once."""
    names: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        for name in SETS.get(part, (part,)):
            if name not in names:
                names.append(name)
    return names


def write_trace(shape: Shape | Mix, path: Path) -> int:
    """Write ``shape``'s trace (one request per line, 64-token hash blocks); returns the request count."""
    rng = random.Random(shape.seed)
    next_id = [1_000_000]

    def fresh(tokens: int) -> list[int]:
        n = tokens // BLOCK
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    if isinstance(shape, Mix):  # each part's sessions, then every row in order of its session's start
        parts = [_session_rows(part, rng, fresh, f"{shape.seed}.{i}") for i, part in enumerate(shape.parts)]
        rows = sorted((r for part in parts for r in part), key=lambda r: r["timestamp"])  # stable: turns in order
    else:
        rows = _session_rows(shape, rng, fresh, str(shape.seed))
    with path.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)


def _session_rows(shape: Shape, rng: random.Random, fresh: Callable[[int], list[int]], tag: str) -> list[dict]:
    """``shape``'s sessions as trace rows, session after session; hash ids from ``fresh``."""
    prompts = [fresh(shape.shared) for _ in range(shape.groups)]
    teams = [[p + fresh(shape.subshared) for _ in range(shape.subgroups)] for p in prompts] if shape.subgroups else []
    rows: list[dict] = []

    def row(sid: str, turn: int, t0: float, ctx: list[int], out: int) -> None:
        rows.append({"session_id": sid, "turn": turn, "timestamp": int(t0),
                     "delay": rng.randint(*shape.think_ms) if turn else 0,
                     "input_length": len(ctx) * BLOCK, "output_length": out, "hash_ids": list(ctx)})

    t0 = 0.0
    on, off = shape.waves
    for s in range(shape.sessions):
        sid = f"{tag}-{s:04d}"
        g = rng.randrange(shape.groups)
        shared = prompts[g]
        ctx = (teams[g][rng.randrange(shape.subgroups)] if teams else shared) + fresh(rng.randint(*shape.first))
        t0 += rng.expovariate(1.0 / shape.arrival_ms)
        if on and t0 % (on + off) >= on:  # between waves: the next one's start
            t0 += on + off - t0 % (on + off)
        turns = rng.randint(*(shape.long_turns if shape.long and rng.random() < shape.long else shape.turns))
        before: list[list[int]] = []  # the prompts of the turns so far
        for k in range(turns):
            out = int(min(shape.output[1], max(shape.output[0], rng.lognormvariate(shape.output_mu, shape.output_sigma))))
            if k and shape.rewind and rng.random() < shape.rewind:  # back 1-3 turns, then a new message
                ctx = before[-rng.randint(1, min(3, len(before)))] + fresh(rng.randint(*shape.growth))
            row(sid, k, t0, ctx, out)
            before.append(ctx)
            if shape.fanout and rng.random() < shape.fanout:
                sub = shared + fresh(rng.randint(1000, 4000))
                for j in range(3):
                    row(f"{sid}-sub{k}", j, t0, sub, out)
                    sub = sub + fresh(rng.randint(500, 2000))
            ctx = ctx + fresh(out + rng.randint(*shape.growth))
            if len(ctx) * BLOCK > shape.max_context:
                if not shape.compact[1]:
                    break
                ctx = shared + fresh(rng.randint(*shape.compact))  # a new prefix past the shared prompt
    return rows


MODES = ("agg", "pd")


def cluster_args(mode: str, workers: int) -> list[str]:
    """The CLI's cluster flags: ``workers`` engines, or for P/D a quarter of them prefilling."""
    if mode == "agg":
        return ["--workers", str(workers)]
    prefill = max(1, workers // 4)
    return ["--prefill", str(prefill), "--decode", str(workers - prefill)]


def run(trace: Path, mode: str, extra: list[str], workers: int = 16, policy: str = "all") -> list[dict]:
    cmd = [sys.executable, "-m", "disagg", "sim", "run", "--trace", str(trace), "--block-size", str(BLOCK),
           "--policy", policy, "--json", *cluster_args(mode, workers), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def verdict(rows: list[dict]) -> dict:
    """The suite's verdict (``router_suite.verdict``) on a cell's rows, the state-aware router's first."""
    from router_suite import verdict as suite_verdict  # this script's directory is on sys.path

    assert rows[0]["policy"] == "state_aware"
    return suite_verdict({r["policy"]: r for r in rows})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/heldout")
    ap.add_argument("--shapes", default="first",
                    help="comma list of shapes (" + ", ".join(SHAPES) + ") or sets (" + ", ".join(SETS)
                    + "); default: the first set")
    ap.add_argument("--modes", default="agg", help="comma list of agg, pd")
    ap.add_argument("--workers", default="16", help="comma list of cluster sizes (engines), e.g. 16,64")
    ap.add_argument("--retention", help="passed to disagg sim run (default: the CLI's)")
    ap.add_argument("--host-write", choices=HOST_WRITES, help="passed to disagg sim run (default: the CLI's)")
    ap.add_argument("--host-policy", choices=HOST_POLICIES, help="passed to disagg sim run (default: the CLI's, lru)")
    ap.add_argument("--session-ends", nargs="?", const="turn", choices=("turn", "after"),
                    help="passed to disagg sim run: clients say when a session ends, with its last turn "
                         "(session_end; the flag alone) or after its answer (DELETE)")
    ap.add_argument("--output-hint", choices=OUTPUT_HINTS,
                    help="passed to disagg sim run: what the router is told of outputs (default: the CLI's, none)")
    ap.add_argument("--profile", help="passed to disagg sim run: the engine's cost profile (default: the CLI's, "
                                      "small), e.g. h200-small or mi355x-k3")
    ap.add_argument("--router-costs", choices=ROUTER_COSTS,
                    help="passed to disagg sim run: what the state-aware router prices time with (default: the "
                         "CLI's, engine)")
    ap.add_argument("--router-config", help="passed to disagg sim run: the state-aware router's config "
                                            "(JSON text or a file)")
    ap.add_argument("--chunk-cache", action="store_true",
                    help="passed to disagg sim run: engines cache each prefill chunk as it completes (vLLM's)")
    ap.add_argument("--keep-turns", type=keep_turns_arg, metavar="auto|N",
                    help="passed to disagg sim run: retention demotes a session's checkpoints of turns older "
                         "than its newest N (every policy; default: the CLI's, 0, no limit)")
    ap.add_argument("--jobs", type=int, default=1, help="cells run at once (each a disagg sim run process)")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="added to every shape's seed: other traces of the same shapes (files and cells are "
                         "named <shape>+N)")
    ap.add_argument("--split-policies", action="store_true",
                    help="each policy of a cell its own process (module docstring); rows kept in OUT/rows/ "
                         "and taken from there by a later run into OUT")
    ap.add_argument("--reuse-baselines", metavar="DIR",
                    help="take the baselines' rows from DIR (an earlier run of the same shapes and flags) and "
                         "run only the state-aware router")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = (["--retention", args.retention] if args.retention else []) + \
        (["--host-write", args.host_write] if args.host_write else []) + \
        (["--host-policy", args.host_policy] if args.host_policy else []) + \
        (["--session-ends", args.session_ends] if args.session_ends else []) + \
        (["--router-config", args.router_config] if args.router_config else []) + \
        (["--output-hint", args.output_hint] if args.output_hint else []) + \
        (["--profile", args.profile] if args.profile else []) + \
        (["--router-costs", args.router_costs] if args.router_costs else []) + \
        (["--chunk-cache"] if args.chunk_cache else []) + \
        (["--keep-turns", str(args.keep_turns)] if args.keep_turns is not None else [])
    try:
        sizes = [int(w) for w in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers: a comma list of integers, got {args.workers!r}")
    if args.jobs < 1:
        ap.error("--jobs: at least 1")
    if min(sizes) < 2:
        ap.error("--workers: at least 2 (P/D needs a prefill and a decode engine)")
    cells = [(s, w, m) for s in shape_names(args.shapes) for w in sizes for m in args.modes.split(",")]
    unknown = ({s for s, _, _ in cells} - set(SHAPES)) | ({m for _, _, m in cells} - set(MODES))
    if unknown:
        ap.error(f"unknown shapes or modes: {sorted(unknown)}")
    traces: dict[str, Path] = {}
    for name in dict.fromkeys(s for s, _, _ in cells):  # written first, in order: the runs only read them
        tag = f"{name}+{args.seed_offset}" if args.seed_offset else name
        traces[name] = out / f"{tag}.jsonl"
        if not traces[name].exists():
            write_trace(replace(SHAPES[name], seed=SHAPES[name].seed + args.seed_offset), traces[name])

    def label_of(name: str, workers: int, mode: str) -> str:
        tag = traces[name].stem
        return f"{tag}/{mode}" if workers == 16 else f"{tag}/{workers}/{mode}"

    def stored_baselines(cell: tuple[str, int, str]) -> list[dict] | None:
        stored = Path(args.reuse_baselines or "") / f"{label_of(*cell).replace('/', '_')}.json"
        if args.reuse_baselines and stored.exists():  # the baselines as they ran; the router's row is new
            return [r for r in json.loads(stored.read_text()) if r["policy"] != "state_aware"]
        return None

    def one(cell: tuple[str, int, str]) -> list[dict]:
        name, workers, mode = cell
        baselines = stored_baselines(cell)
        if baselines is not None:
            return run(traces[name], mode, extra, workers, policy="state_aware") + baselines
        return run(traces[name], mode, extra, workers)

    def one_policy(task: tuple[tuple[str, int, str], str]) -> dict:
        (name, workers, mode), policy = task
        kept = out / "rows" / f"{label_of(name, workers, mode).replace('/', '_')}.{policy}.json"
        if kept.exists():
            return json.loads(kept.read_text())
        (row,) = run(traces[name], mode, extra, workers, policy=policy)
        kept.parent.mkdir(exist_ok=True)
        kept.write_text(json.dumps(row))
        return row

    def by_cell(pool: ThreadPoolExecutor):
        """Each cell's rows, in the cells' order (``--split-policies``: a task per policy)."""
        if not args.split_policies:
            yield from pool.map(one, cells)
            return
        stored = {cell: stored_baselines(cell) for cell in cells}  # read once a cell
        mine = {cell: POLICIES if stored[cell] is None else ["state_aware"] for cell in cells}
        rows = pool.map(one_policy, [(cell, p) for cell in cells for p in mine[cell]])
        for cell in cells:
            yield [next(rows) for _ in mine[cell]] + (stored[cell] or [])

    summary: dict[str, dict] = {}
    with ThreadPoolExecutor(args.jobs) as pool:  # each cell (or policy of a cell) its own ``disagg sim run``
        done = tqdm(by_cell(pool), total=len(cells), desc="held-out shapes", unit="cell", file=sys.stderr)
        for cell, rows in zip(cells, done, strict=True):  # printed in the cells' order
            label = label_of(*cell)
            (out / f"{label.replace('/', '_')}.json").write_text(json.dumps(rows, indent=1))
            v = summary[label] = verdict(rows)
            print(f"\n{label} ({rows[0]['requests']} requests)")
            for r in rows:
                print(f"  {r['policy']:>16}  hit {r['hit_rate']:.3f}"
                      f"  hit/bound {r.get('hit_vs_bound', float('nan')):.3f}"
                      f"  TTFT P50 {r['ttft_p50']:.3f}  P90 {r['ttft_p90']:.3f}"
                      f"  P90 interactivity {r['interactivity_p90']:.1f}  tok/s/GPU {r['tokens_per_s_per_gpu']:,.0f}")
            print(f"  state_aware over the best baseline: TTFT P90 x{v['ttft_p90']:.3f} ({v['ttft_p90_best']}),"
                  f" P90 interactivity x{v['interactivity_p90']:.4f} ({v['interactivity_p90_best']}),"
                  f" tok/s/GPU x{v['tokens_per_s_per_gpu']:.3f} ({v['tokens_per_s_per_gpu_best']}),"
                  f" hit/bound {v['hit_vs_bound']:.3f} -> {'PASS' if v['pass'] else 'miss'}", flush=True)
    path = out / "summary.json"  # other sizes, seeds and sets run into OUT before stay in it
    kept = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(kept | summary, indent=1))
    # the suite's chart of verdicts (this script's directory is on sys.path)
    from router_suite import plot

    plot(summary, out / "summary.png", title="Held-out shapes")
    print(f"\n{sum(v['pass'] for v in summary.values())}/{len(summary)} cells reach every figure")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
