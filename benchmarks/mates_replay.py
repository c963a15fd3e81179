"""Two workers of one node, on the real serving path: what a node mate's device holds, recalled.

Two in-process aggregated workers (each its own engine: the reference engine's tiny
K3-architecture model on CPU) share their node's host tier, as the replicas of a node do. The
requests are spread over both, as a router spreading load sends them, so a prefix one worker's
device holds is often wanted by the other:

- ``docqa``: D documents of 8 blocks; in each of R rounds every document gets a new question
  (its own session), on worker (round + document) mod 2. A document's later questions can resume
  the whole document.
- ``moved``: D sessions of R turns; turn t of session s runs on worker (s + t) mod 2, so every
  turn moves to the other worker. A turn can resume its previous turn's end.

Modes, each with the same engine cache and host tier:

- ``through``: turns written through to the host tier (``transfer.host.victim: false``; the
  default until docs/router.md "Round 43");
- ``victim-own``: ``transfer.host.victim`` without recalls (``recall_ms: 0``): the tier lets go
  first what a device holds, so the mate that wants it computes it (docs/router.md "Round 41");
- ``victim``: with recalls (``kv_transfer.tiers.host`` NOTE 9): the mate asks, the holder writes
  back from its device, the mate loads it.

Per D and mode it prints hit / reachable (cached prompt tokens over the tokens a request could
resume), where cached tokens came from, recalls answered, and the host tier's evictions. Every
mode must produce the same tokens (greedy): the script checks it and exits 1 if not.

    python benchmarks/mates_replay.py                                  # docqa, D = 2..24
    python benchmarks/mates_replay.py --shape moved --json results/mates_moved.json --plot docs/mates_moved.png
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
MODES = ("through", "victim-own", "victim")


def _ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(4, 260) for _ in range(n)]


def _node(mode: str, device_mb: int, host_mb: int, slab_kb: int) -> list[InProcessBackend]:
    """Two aggregated workers sharing one host tier."""
    cfg = load_config({
        "model": {"name": "tiny"},
        "engine": {"cache_budget_mb": device_mb, "max_num_batched_tokens": 512, "num_threads": 1},
        "transfer": {"host": {"capacity_mb": host_mb, "pin_memory": False, "slab_kb": slab_kb,
                              "victim": mode != "through", "recall_ms": 250 if mode == "victim" else 0}},
        "deployment": {"mode": "aggregated"}})
    first = InProcessBackend(cfg)
    return [first, InProcessBackend(cfg, store=first.store)]


def _questions(n: int, rounds: int, doc_blocks: int):
    """docqa's requests in serving order: (worker, request id, prompt, reachable tokens)."""
    docs = [_ids(doc_blocks * BS, 100 + d) for d in range(n)]
    for r in range(rounds):
        for d in range(n):
            yield (r + d) % 2, f"d{d}-q{r}", docs[d] + _ids(40, 7919 * (d + 1) + r), len(docs[d]) if r else 0


async def _replay(node: list[InProcessBackend], args, n: int) -> dict:
    sampling = SamplingParams(max_tokens=args.out_tokens, ignore_eos=True)
    sources: Counter[str] = Counter()
    outputs, cached, reachable = [], 0, 0

    async def one(worker: int, rid: str, session: str, prompt: list[int]):
        out, last = await node[worker].complete(GenerateParams(rid, prompt, sampling, session_id=session))
        outputs.append(out)
        sources[last.cached_source if last.num_cached_tokens else "computed"] += 1
        return out, last

    if args.shape == "docqa":
        for worker, rid, prompt, reach in _questions(n, args.rounds, args.doc_blocks):
            _, last = await one(worker, rid, rid, prompt)  # each question its own session
            cached += min(last.num_cached_tokens, reach)
            reachable += reach
    else:  # moved: every turn on the other worker
        convo = {s: _ids(args.doc_blocks * BS + 20, 1000 + s) for s in range(n)}
        ended: dict[int, int] = {}
        for t in range(args.rounds):
            for s in range(n):
                out, last = await one((s + t) % 2, f"s{s}-t{t}", f"s{s}", convo[s])
                cached += min(last.num_cached_tokens, ended.get(s, 0))
                reachable += ended.get(s, 0)
                ended[s] = len(convo[s]) + len(out) - 1  # the last token sampled is not computed yet
                convo[s] = convo[s] + out + _ids(args.grow, 7919 * (s + 1) + t)
    host = node[0].store.tiers[0].stats()
    holds = [w.decode.stats().get("device_holds", {}) for w in node]
    flows = [w.decode.stats() for w in node]
    return {"cached_tokens": cached, "reachable_tokens": reachable,
            "hit_over_reachable": cached / reachable if reachable else 0.0, "sources": dict(sources),
            "recalls_answered": sum(h.get("recalls_answered", 0) for h in holds),
            "recalled_objects": sum(h.get("recalled_objects", 0) for h in holds),
            "recall_resumes": sum(f["worker"].get("recall_resumes", 0) for f in flows),
            "host_evictions": host["num_evictions"], "recall_timeouts": host["num_recall_timeouts"],
            "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("docqa", "moved"), default="docqa")
    ap.add_argument("--count", default="2,4,6,8,12,16,24", help="comma list of documents (docqa) or sessions (moved)")
    ap.add_argument("--rounds", type=int, default=4, help="questions per document, or turns per session")
    ap.add_argument("--doc-blocks", type=int, default=8, help="a document's blocks (moved: the first prompt's)")
    ap.add_argument("--grow", type=int, default=70, help="moved: new message tokens per later turn")
    ap.add_argument("--out-tokens", type=int, default=8, help="answer tokens per request")
    ap.add_argument("--device-mb", type=int, default=24, help="each engine's cache")
    ap.add_argument("--host-mb", type=int, default=24, help="the node's host tier")
    ap.add_argument("--slab-kb", type=int, default=512, help="the host tier's slabs")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--plot", help="draw hit / reachable against the count, every mode, into this PNG")
    ap.add_argument("--replot", metavar="JSON", help="only draw --plot from a run's --json")
    args = ap.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        _plot(saved["rows"], argparse.Namespace(**saved["args"]), Path(args.plot or "mates_replay.png"))
        return 0
    counts = [int(x) for x in args.count.split(",")]
    rows, mismatches = [], 0
    print(f"{'n':>3} {'mode':<10} {'hit/reach':>9} {'device':>7} {'host':>5} {'computed':>8} {'recalled':>8} "
          f"{'host evict':>10} {'s':>6}", flush=True)
    for n in counts:
        got = {}
        for mode in MODES:
            t0 = time.perf_counter()
            node = _node(mode, args.device_mb, args.host_mb, args.slab_kb)
            try:
                got[mode] = asyncio.run(_replay(node, args, n))
            finally:
                for w in node:
                    w.shutdown()
            r, src = got[mode], got[mode]["sources"]
            print(f"{n:>3} {mode:<10} {r['hit_over_reachable']:>9.3f} {src.get('device', 0):>7} {src.get('host', 0):>5} "
                  f"{src.get('computed', 0):>8} {r['recalls_answered']:>8} {r['host_evictions']:>10} "
                  f"{time.perf_counter() - t0:>6.1f}", flush=True)
        outs = [got[m].pop("outputs") for m in MODES]
        same = all(o == outs[0] for o in outs)
        mismatches += not same
        rows.append({"count": n, "same_tokens": same, **got})
    print(f"tokens identical in every mode: {len(rows) - mismatches} of {len(rows)} sweeps")
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
    xs = [r["count"] for r in rows]
    for mode, style in zip(MODES, ("o--", "^:", "s-"), strict=True):
        ax.plot(xs, [r[mode]["hit_over_reachable"] for r in rows], style, label=mode)
    ax.set_xlabel("documents" if args.shape == "docqa" else "sessions (every turn on the other worker)")
    ax.set_ylabel("hit / reachable")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{args.shape}, two workers of one node: {args.device_mb} MiB engine cache each, "
                 f"{args.host_mb} MiB host tier", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
