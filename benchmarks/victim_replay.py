"""Serving's ``transfer.host.victim`` against write-through, on the real serving path.

An in-process aggregated worker (the reference engine's tiny K3-architecture model on CPU, its
node's host tier, the request flow) serves S sessions of T turns, turn-major: every session's
turn t, then every session's turn t+1, so a session's next turn comes after S-1 others. Each
later turn appends the answer and a new message to the conversation; sessions share nothing.
The engine's device cache and the host tier each hold a few of the sessions; the sweep over S
crosses both.

Written through, the host tier holds copies of what the device holds, so a session comes back
when it is among the last ~max(device, host) sessions served. As the devices' victim cache
(``disagg.workers.holds``) the host tier lets go first of what the device holds and gets back
what the device evicts, so the node holds about device + host.

Per S and mode it prints: hit / reachable (cached prompt tokens over the tokens a next turn
could resume, the previous turn's end), where the cached tokens came from (device, host), the
engine's resident evictions, the host tier's evictions, and what was written back. Both modes
must produce the same tokens (greedy): the script checks it and says so.

    python benchmarks/victim_replay.py                       # S = 10, 18, 22, 26, 30, 34, 42
    python benchmarks/victim_replay.py --sessions 8,16 --turns 3 --json results/victim_replay.json
    python benchmarks/victim_replay.py --replot results/victim_replay.json --plot docs/img/victim_replay.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from disagg.config import load_config  # noqa: E402
from disagg.engine.protocol import SamplingParams  # noqa: E402
from disagg.launch.inprocess import InProcessBackend  # noqa: E402
from disagg.messages import GenerateParams  # noqa: E402

BS = 64


def _ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(4, 260) for _ in range(n)]


def _backend(victim: bool, device_mb: int, host_mb: int, slab_kb: int) -> InProcessBackend:
    return InProcessBackend(load_config({
        "model": {"name": "tiny"},
        "engine": {"cache_budget_mb": device_mb, "max_num_batched_tokens": 512, "num_threads": 1},
        "transfer": {"host": {"capacity_mb": host_mb, "pin_memory": False, "victim": victim, "slab_kb": slab_kb}},
        "deployment": {"mode": "aggregated"}}))


async def _replay(b: InProcessBackend, sessions: int, turns: int, first: int, grow: int, out_tokens: int) -> dict:
    convo = {s: _ids(first, 1000 + s) for s in range(sessions)}
    ended: dict[int, int] = {}  # session -> tokens its last turn computed (a next turn's reach)
    sampling = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    sources: Counter[str] = Counter()
    outputs, prompt_tokens, cached, reachable = [], 0, 0, 0
    for t in range(turns):
        for s in range(sessions):
            prompt = convo[s]
            params = GenerateParams(f"s{s}-t{t}", prompt, sampling, session_id=f"s{s}")
            out, last = await b.complete(params)
            outputs.append(out)
            prompt_tokens += len(prompt)
            cached += last.num_cached_tokens
            reachable += ended.get(s, 0)
            sources[last.cached_source if last.num_cached_tokens else "computed"] += 1
            ended[s] = len(prompt) + len(out) - 1  # the last token sampled is not computed yet
            convo[s] = prompt + out + _ids(grow, 7919 * (s + 1) + t)
    stats = b.decode.stats()
    host = b.store.tiers[0].stats()
    holds = stats.get("device_holds", {})
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached, "reachable_tokens": reachable,
            "hit_over_reachable": cached / reachable if reachable else 0.0, "sources": dict(sources),
            "resident_evictions": stats["engine"]["resident_evictions"], "host_evictions": host["num_evictions"],
            "written_back_objects": holds.get("written_back", 0), "write_backs_dropped": holds.get("write_back_dropped", 0),
            "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="10,18,22,26,30,34,42", help="comma list of session counts S")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=6 * BS + 20, help="first prompt's tokens")
    ap.add_argument("--grow", type=int, default=70, help="new message tokens per later turn")
    ap.add_argument("--out-tokens", type=int, default=8, help="answer tokens per turn")
    ap.add_argument("--device-mb", type=int, default=24, help="engine cache (MLA blocks + 16 KDA slots)")
    ap.add_argument("--host-mb", type=int, default=24, help="the node's host tier")
    ap.add_argument("--slab-kb", type=int, default=512,
                    help="the host tier's slabs (a small tier's derived slabs are few: its size classes "
                         "would evict one another)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--plot", help="draw hit / reachable against S, both modes, into this PNG")
    ap.add_argument("--replot", metavar="JSON", help="only draw --plot from a run's --json")
    args = ap.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        _plot(saved["rows"], argparse.Namespace(**saved["args"]), Path(args.plot or "victim_replay.png"))
        return 0
    counts = [int(x) for x in args.sessions.split(",")]
    rows, mismatches = [], 0
    print(f"{'S':>3} {'mode':<8} {'hit/reach':>9} {'device':>7} {'host':>5} {'computed':>8} {'res.evict':>9} "
          f"{'host evict':>10} {'written back':>12} {'s':>6}", flush=True)
    for n in counts:
        got = {}
        for mode in ("through", "victim"):
            t0 = time.perf_counter()
            b = _backend(mode == "victim", args.device_mb, args.host_mb, args.slab_kb)
            try:
                got[mode] = asyncio.run(_replay(b, n, args.turns, args.first, args.grow, args.out_tokens))
            finally:
                b.shutdown()
            r = got[mode]
            src = r["sources"]
            print(f"{n:>3} {mode:<8} {r['hit_over_reachable']:>9.3f} {src.get('device', 0):>7} {src.get('host', 0):>5} "
                  f"{src.get('computed', 0):>8} {r['resident_evictions']:>9} {r['host_evictions']:>10} "
                  f"{r['written_back_objects']:>12} {time.perf_counter() - t0:>6.1f}", flush=True)
        same = got["through"].pop("outputs") == got["victim"].pop("outputs")
        mismatches += not same
        rows.append({"sessions": n, "same_tokens": same, **{m: got[m] for m in got}})
    print(f"tokens identical in both modes: {len(rows) - mismatches} of {len(rows)} sweeps")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if args.plot:
        _plot(rows, args, Path(args.plot))
    return 1 if mismatches else 0


def _plot(rows: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = [r["sessions"] for r in rows]
    for mode, style in (("through", "o--"), ("victim", "s-")):
        ax.plot(xs, [r[mode]["hit_over_reachable"] for r in rows], style, label=mode)
    ax.set_xlabel("sessions S (a session's next turn comes after S-1 others)")
    ax.set_ylabel("hit / reachable")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"one worker: {args.device_mb} MiB engine cache, {args.host_mb} MiB host tier", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
