"""Sessions that end, served for real: what telling the server buys, by how the client tells it.

A fixed number of sessions are live at once and take turns round-robin (each
one's think time is the others' turns); when a session has taken its turns it
ends and the next one takes its place, so ended sessions pile up behind the
live ones. Every session starts with the same system prompt; each next prompt is
the previous prompt, its output and a new message. The replay runs through
``InProcessBackend`` (tiny reference model on CPU, aggregated, device-resident
sessions off: every follow-up resumes from the host tier or recomputes) over an
LRU host tier of ``--host-mb``, too small for every session's state. The same
requests run once per client kind, each on a fresh backend::

    none      the client never says a session ended (recency alone)
    turn      its last turn carries session_end (disagg.flow NOTE 13)
    delete    after its last turn, the client ends it (InProcessBackend.end_session,
              what DELETE /v1/sessions/{id} calls; disagg.flow NOTE 14)

    PYTHONPATH=. python benchmarks/session_end_replay.py --host-mb 24

Prints, per kind: realized / theoretical (prompt tokens reused over the server's
infinite-cache bound, ``reuse_bound``), the ratio of realized tokens to the
first kind's, the host tier's evictions and demoted objects, the state bytes put;
and whether every kind's greedy outputs are identical (they must be: a signal
only reorders eviction).
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
from retention_replay import _ids, print_table, run_each, tiny_backend
from tqdm import tqdm

from disagg.engine.protocol import SamplingParams
from disagg.launch.inprocess import InProcessBackend
from disagg.messages import GenerateParams

KINDS = ("none", "turn", "delete")


def _sessions(args) -> list[tuple[int, list[list[int]]]]:
    """Per session, its number of turns and each turn's new message (the same for every kind)."""
    rng = random.Random(args.seed)
    return [(t, [_ids(rng.randrange(args.min_new, args.max_new + 1), rng) for _ in range(t)])
            for t in (rng.randint(args.min_turns, args.max_turns) for _ in range(args.sessions))]


async def _replay(b: InProcessBackend, kind: str, args, system: list[int], plan) -> tuple[dict, list[list[int]]]:
    live: list[int | None] = list(range(min(args.live, len(plan))))  # slot -> session
    waiting = iter(range(len(live), len(plan)))
    convo = {s: list(system) for s in range(len(plan))}
    taken = dict.fromkeys(range(len(plan)), 0)
    realized = bound = prompt = 0
    outputs: list[list[int]] = []
    bar = tqdm(total=sum(t for t, _ in plan), desc=kind, unit="turn", leave=False, file=sys.stderr)
    while any(s is not None for s in live):
        for slot, s in enumerate(live):
            if s is None:
                continue
            turns, messages = plan[s]
            k = taken[s]
            last = k == turns - 1
            tokens = convo[s] + messages[k]
            p = GenerateParams(f"s{s}-t{k}", tokens, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                               session_id=f"s{s}", session_end=last and kind == "turn")
            out, chunk = await b.complete(p)
            outputs.append(out)
            convo[s] = tokens + out
            taken[s] += 1
            prompt += len(tokens)
            realized += chunk.num_cached_tokens
            bound += chunk.reuse_bound
            bar.update(1)
            if last:
                if kind == "delete":
                    await b.end_session(f"s{s}")
                live[slot] = next(waiting, None)
    bar.close()
    host = b.store.tiers[0].stats()
    return {"prompt": prompt, "realized": realized, "bound": bound, "evictions": host["num_evictions"],
            "demoted": host["num_demoted"], "published_mb": b.store.stats()["bytes_put"] / (1 << 20)}, outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=24, help="sessions in all")
    ap.add_argument("--live", type=int, default=6, help="sessions live at once (taking turns round-robin)")
    ap.add_argument("--min-turns", type=int, default=3)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=320, help="shared system prompt (5 blocks of 64)")
    ap.add_argument("--min-new", type=int, default=120, help="new tokens per turn, at least")
    ap.add_argument("--max-new", type=int, default=260, help="new tokens per turn, at most")
    ap.add_argument("--max-tokens", type=int, default=4, help="greedy tokens per request")
    ap.add_argument("--host-mb", type=int, default=24, help="host tier capacity (MiB)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: a comma list of {', '.join(KINDS)}")
    torch.set_num_threads(1)
    plan = _sessions(args)
    system = _ids(args.system_tokens, random.Random(args.seed + 1))
    results, outs = run_each(
        kinds, lambda _: tiny_backend(args.host_mb, "lru", mode="aggregated"),
        lambda b, kind: _replay(b, kind, args, system, plan),
        lambda kind: f"{kind}: {args.sessions} sessions, {args.live} live, host {args.host_mb} MiB (lru)")
    print_table("client", kinds, results)
    print(f"greedy outputs identical across client kinds: {all(o == outs[0] for o in outs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
