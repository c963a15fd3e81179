"""Session retention in a host tier too small for every session: realized / theoretical hit, off vs on.

Sessions share a system prompt and take turns round-robin (each session's think
time is every other session's turn); each next prompt is the previous prompt,
its output and a new message. The replay runs through ``InProcessBackend``
(tiny reference model on CPU, disaggregated) over a host tier of
``--host-mb`` (small slabs, so eviction follows the policy), with device-resident
sessions off: every follow-up resumes from the host tier or recomputes. The
same requests run once per ``--keep`` setting (``transfer.host.keep_checkpoints``,
0 = off, recency alone; ``K/T`` also sets ``keep_turns``), each on a fresh
backend; ``--rewind`` sends some turns back to an earlier point of their
conversation (an edit, a retry), so that older turns' checkpoints are wanted::

    PYTHONPATH=. python benchmarks/retention_replay.py --sessions 12 --turns 6 --host-mb 48
    PYTHONPATH=. python benchmarks/retention_replay.py --sessions 16 --turns 10 --host-mb 64 --policy lru \
        --keep 8/0,8/1,8/auto [--rewind 0.2]

Prints, per run: realized / theoretical (prompt tokens reused over the server's
infinite-cache bound, ``reuse_bound``), the misses by reason, the host tier's
evictions and demoted objects, the state bytes put; the ratio of each run's realized tokens to the
first run's; and whether every run's greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import torch

from disagg.config import load_config
from disagg.engine.protocol import SamplingParams
from disagg.launch.inprocess import InProcessBackend
from disagg.messages import GenerateParams
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(4, 260) for _ in range(n)]


def tiny_backend(host_mb: int, policy: str, mode: str = "disaggregated", **host) -> InProcessBackend:
    """The in-process backend (tiny reference model on CPU, device-resident sessions off) over a
    host tier of ``host_mb`` MiB with ``policy`` eviction and 1 MiB slabs (so eviction follows
    the policy); ``host``: more ``transfer.host`` settings."""
    cfg = load_config({
        "model": {"name": "tiny"},
        "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 256, "num_threads": 1,
                   "resident_sessions": False},
        "transfer": {"host": {"capacity_mb": host_mb, "pin_memory": False, "policy": policy, **host}},
        "router": {"local_prefill_max_tokens": 64}, "deployment": {"mode": mode}})
    probe = InProcessBackend(cfg, host_tier=False)  # only for the engine's state layout
    layout = probe.decode.engine.layout
    probe.shutdown()
    tier = HostTier(host_mb << 20, eviction=policy, slab_bytes=1 << 20)
    return InProcessBackend(cfg, store=StateStore([tier], layout))


def run_each(labels: list, build, replay, describe) -> tuple[list[dict], list[list[list[int]]]]:
    """Per label, a fresh backend (``build(label)``) and ``replay(backend, label)`` on it:
    (the replays' figures, each with its ``seconds``; their greedy outputs)."""
    results, outs = [], []
    for label in labels:
        print(describe(label), file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        b = build(label)
        try:
            r, o = asyncio.run(replay(b, label))
        finally:
            b.shutdown()
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        outs.append(o)
    return results, outs


def print_table(name: str, labels: list, results: list[dict], extra=None) -> None:
    """One row per label: realized / theoretical, realized over the first row's, the host tier's
    evictions and demotions, the bytes put (``extra(r)``: a last column)."""
    base = results[0]["realized"] or 1
    width = max(len(name), 5)
    print(f"{name:>{width}} {'realized/theoretical':>21} {'vs first':>9} {'realized':>9} {'bound':>8} {'prompt':>8} "
          f"{'evictions':>9} {'demoted':>8} {'put MiB':>8}" + ("  misses (tokens by reason)" if extra else ""))
    for label, r in zip(labels, results, strict=True):
        ratio = r["realized"] / r["bound"] if r["bound"] else 0.0
        print(f"{label!s:>{width}} {ratio:>21.3f} {r['realized'] / base:>8.2f}x {r['realized']:>9} {r['bound']:>8} "
              f"{r['prompt']:>8} {r['evictions']:>9} {r['demoted']:>8} {r['published_mb']:>8.1f}"
              + (f"  {extra(r)}" if extra else ""))


def _setting(text: str) -> tuple[int, int | str]:
    """``--keep`` item: ``K`` or ``K/T``, keep_checkpoints K and keep_turns T (default 0: no limit)."""
    keep, _, turns = text.partition("/")
    return int(keep), (turns if turns == "auto" else int(turns or 0))


def _backend(args, setting: tuple[int, int | str]) -> InProcessBackend:
    keep, turns = setting
    return tiny_backend(args.host_mb, args.policy, keep_checkpoints=keep, keep_turns=turns)


async def _replay(b: InProcessBackend, args) -> tuple[dict, list[list[int]]]:
    rng = random.Random(args.seed)
    system = _ids(args.system_tokens, rng)
    convos = [system for _ in range(args.sessions)]
    history: list[list[list[int]]] = [[] for _ in range(args.sessions)]  # each session's conversation ends
    realized = bound = prompt = 0
    misses: dict[str, int] = {}
    outputs = []
    for turn in range(args.turns):
        for s in range(args.sessions):
            if args.rewind and history[s] and rng.random() < args.rewind:  # back 1-3 turns, asked again
                # (no draw without --rewind: the same requests as the script's earlier runs)
                convos[s] = history[s][max(0, len(history[s]) - 1 - rng.randrange(1, 4))]
            tokens = convos[s] + _ids(rng.randrange(args.min_new, args.max_new + 1), rng)
            p = GenerateParams(f"s{s}-t{turn}", tokens, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                               session_id=f"s{s}")
            out, last = await b.complete(p)
            outputs.append(out)
            convos[s] = tokens + out
            history[s].append(convos[s])
            prompt += len(tokens)
            realized += last.num_cached_tokens
            bound += last.reuse_bound
            for reason, n in (last.reuse_misses or {}).items():
                misses[reason] = misses.get(reason, 0) + n
        print(f"  turn {turn + 1}/{args.turns} done", file=sys.stderr, flush=True)
    host = b.store.tiers[0].stats()
    retention = b.decode.flow.reuse.retention
    learned = retention.turns() if retention is not None and retention.ages is not None else None  # auto
    return {"prompt": prompt, "realized": realized, "bound": bound, "misses": misses, "learned": learned,
            "evictions": host["num_evictions"], "demoted": host["num_demoted"],
            "published_mb": b.store.stats()["bytes_put"] / (1 << 20)}, outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=320, help="shared system prompt (5 blocks of 64)")
    ap.add_argument("--min-new", type=int, default=120, help="new tokens per turn, at least")
    ap.add_argument("--max-new", type=int, default=260, help="new tokens per turn, at most")
    ap.add_argument("--max-tokens", type=int, default=4, help="greedy tokens per request")
    ap.add_argument("--host-mb", type=int, default=48, help="host tier capacity (MiB)")
    ap.add_argument("--policy", default="s3fifo", choices=("lru", "s3fifo", "arc"))
    ap.add_argument("--keep", default="0,8/0,8/auto",
                    help="settings to run: keep_checkpoints K (0: off) or K/T with keep_turns T (auto, or N; "
                         "default 0: no limit)")
    ap.add_argument("--rewind", type=float, default=0.0,
                    help="chance that a turn goes back 1-3 turns of its conversation first (an edit, a retry)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    labels = args.keep.split(",")
    results, outs = run_each(
        labels, lambda label: _backend(args, _setting(label)), lambda b, _: _replay(b, args),
        lambda label: f"keep_checkpoints/keep_turns={label}: {args.sessions} sessions x {args.turns} turns, "
                      f"rewind {args.rewind}, host {args.host_mb} MiB ({args.policy})")
    print_table("keep", labels, results, lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["misses"].items()))
                + ("" if r["learned"] is None else f"; keep_turns learned: {r['learned']}"))
    print(f"greedy outputs identical across runs: {all(o == outs[0] for o in outs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
