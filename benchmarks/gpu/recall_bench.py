"""What a recall of a node mate's device costs on a GPU, against recompute and a host-tier hit.

    python benchmarks/gpu/recall_bench.py --context 8192,32768,131072 --json OUT/recall.json

For each context (``small`` preset, bf16 by default): a holder engine prefills a document of that
many tokens and keeps it resident; its ``DeviceHolds`` holds the keys in the node's host tier (a
page-locked arena) and listens for recalls, as a decoding replica with ``transfer.host.victim``
does. The host tier then lets the document go (deleted here; in serving, held keys go first). A
second engine on the same GPU answers a new question on the document, each way ``--reps`` times,
interleaved, medians reported:

    recompute   the whole prompt computed
    recall      ``StateStore.recall`` (the holder exports the state between two of its steps and
                writes it back), then lookup, direct load to the device, and the rest computed
    host        the state already in the host tier: lookup, direct load, the rest computed

and the pieces: ``recall_wait`` (the asker's wait: the holder's export and put), ``export`` (the
holder's export alone: how long the holder's engine is held off its next step). Ratios are
against the recompute of the same run; the first tokens of every path must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from engine_bench import _ids, _store, _sync, make_engine, ttft  # noqa: E402

from disagg.engine.protocol import EngineRequest, SamplingParams  # noqa: E402
from disagg.engine.reference.config import load_preset  # noqa: E402
from disagg.engine.reference.model import K3ForCausalLM  # noqa: E402
from disagg.workers.holds import DeviceHolds  # noqa: E402
from kv_transfer.keys import BlockHasher, KeyExtras  # noqa: E402


def _ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 2)


def run_context(model, args, context: int) -> dict:
    device, vocab = args.device, model.config.vocab_size
    doc = _ids(context, 7, vocab)
    question = doc + _ids(args.followup, 8, vocab)
    holder = make_engine(model, device, args.budget_mb, args.chunk)
    hasher = BlockHasher(64, KeyExtras("bench"))
    holder.generate(EngineRequest("doc", doc, SamplingParams(max_tokens=1, ignore_eos=True), keep_state=True))
    size = holder.export_state("doc")
    nbytes = size.nbytes
    del size
    store = _store(holder.layout, nbytes)
    store.warm(device)
    exports: list[float] = []

    def export(rid: int, position: int, first: int):
        _sync(device)
        t0 = time.perf_counter()
        state = holder.export_resident(rid, position, first)
        _sync(device)
        exports.append(time.perf_counter() - t0)
        return state

    holds = DeviceHolds(store, hasher, export_fn=export)
    holder.on_resident = holds.on_change
    holder.release("doc")  # resident now; its keys held
    assert holds.flush(60) and store.tiers[0].num_held() > 0
    names = ("recompute", "recall", "host")
    times: dict[str, list[float]] = {k: [] for k in (*names, "recall_wait", "load")}
    first_tokens: dict[str, set[int]] = {k: set() for k in names}
    ttft(make_engine(model, device, args.budget_mb, args.chunk, resident_sessions=False), "warm", question, device)
    for r in range(args.reps):
        t, tok = ttft(make_engine(model, device, args.budget_mb, args.chunk, resident_sessions=False),
                      f"c{r}", question, device)
        times["recompute"].append(t)
        first_tokens["recompute"].add(tok)
        for name in ("recall", "host"):
            if name == "recall":
                for key in store.tiers[0].keys():  # the host tier let the document go; the holder holds it
                    store.tiers[0].delete(key)
            eng = make_engine(model, device, args.budget_mb, args.chunk, resident_sessions=False)
            _sync(device)
            t0 = time.perf_counter()
            if name == "recall":
                got = store.recall(question, hasher, 0, len(question) - 1, args.recall_s)
                assert got > 0, "the holder wrote nothing back"
                times["recall_wait"].append(time.perf_counter() - t0)
            point = store.resumable_length(question, hasher, max_position=len(question) - 1)
            t1 = time.perf_counter()
            loaded = store.load_state(question, point.position, hasher, eng.layout, contiguous=True, device=device)
            _sync(device)
            assert loaded is not None and point.position == len(doc), (point.position, len(doc))
            times["load"].append(time.perf_counter() - t1)
            _, tok = ttft(eng, f"{name}{r}", question, device, resume=loaded)
            times[name].append(time.perf_counter() - t0)
            first_tokens[name].add(tok)
            del loaded, eng
    holds.close()
    agree = len(set().union(*first_tokens.values())) == 1
    assert agree, f"first tokens differ: {first_tokens}"
    med = {k: _ms(v) for k, v in times.items()}
    return {"context": context, "state_mb": round(nbytes / 1e6, 1), "export_ms": _ms(exports),
            **{f"{k}_ms": v for k, v in med.items()},
            "recall_vs_recompute": round(med["recall"] / med["recompute"], 3),
            "host_vs_recompute": round(med["host"] / med["recompute"], 3),
            "recall_vs_host": round(med["recall"] / med["host"], 3),
            "reps_ms": {k: [round(1000 * x, 1) for x in v] for k, v in times.items()},
            "holds": holds.stats(), "first_tokens_agree": agree}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", default="8192,32768")
    ap.add_argument("--followup", type=int, default=256, help="the question's tokens after the document")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--budget-mb", type=int, default=20000, help="each engine's cache")
    ap.add_argument("--recall-s", type=float, default=30.0, help="the asker's wait (transfer.host.recall_ms)")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = K3ForCausalLM.random_init(load_preset(args.preset), seed=0, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    ttft(make_engine(model, args.device, args.budget_mb, args.chunk), "warm", _ids(512, 0, 300), args.device)
    out = {"preset": args.preset, "device": args.device, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "contexts": []}
    for c in (int(x) for x in args.context.split(",")):
        fig = run_context(model, args, c)
        out["contexts"].append(fig)
        print(f"context {c}: state {fig['state_mb']} MB; recompute {fig['recompute_ms']} ms, recall "
              f"{fig['recall_ms']} ms (wait {fig['recall_wait_ms']}, holder's export {fig['export_ms']}), "
              f"host {fig['host_ms']} ms; recall/recompute {fig['recall_vs_recompute']}, "
              f"recall/host {fig['recall_vs_host']}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if args.json:  # after each context: a long one that runs out of time keeps the others
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
