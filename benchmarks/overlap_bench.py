"""Prefill with state publishing on, against off, in the same run.

    python benchmarks/overlap_bench.py [--device cuda --preset small --dtype bfloat16]
        [--prompt 8192] [--batch 4] [--rounds 4] [--modes off,on,node,hold,export] [--json out.json]

A round submits ``--batch`` distinct prompts at once to one engine (the
prefill server's engine and worker, in this process) and times the makespan:

    off   engine.generate(max_tokens=1), state dropped         (prefill only)
    on    StatefulWorker.prefill: compute, then export the prompt's state
          (batched device gather) and put it into the host tier (checksummed),
          while the engine goes on stepping the round's other prompts
    node  the same, into a host tier owned by another process (the node's
          store process, as the deployments run it), through its client: the
          blocks go in without checksums and that process seals them

and, with ``--modes``, two partial paths that locate what publishing costs:

    hold    the prompt's state kept after its step (keep_state), then released
    export  kept, exported (the batched gather into pinned host staging, under
            the engine's lock), then released; nothing is put into a tier

Rounds interleave the modes so machine noise hits them alike. Two makespans per
round: ``prefill`` ends when the round's last prompt has its first token (the
engine's work), ``total`` when its last state is also in the host tier (the
last prompt's put runs after every prefill, so ``total`` also counts one
publish's latency, which a continuous stream of prompts would hide). The figures
are median ratios against ``off`` (goal: prefill < 1.05). Every published prompt
is checked to be resumable to its full length from the host tier. Also given:
the median over rounds of each round's ratio to its own ``off`` (paired), with
quartiles: on a host whose CPU time is noisy this is the steadier figure.

GIL probe (``--gil``, no model): what publishing costs the engine's stepping
thread when that thread is bound by Python (as a launch-bound GPU engine is).
The main thread runs a pure-Python loop for ``--window`` seconds at a time;
a publisher thread puts ``--prompt``-token states of the ``small`` preset
(bf16, 44 MB at 8K) into a host tier at ``--publish-mb-s`` (default 225 MB/s:
the H200 overlap run's 8 x 44 MB per 1.57 s makespan; deleting them after
each put), through each path in turn, rounds interleaved with publisher-off
windows:

    progress = median over ``--rounds`` adjacent pairs of windows of
               loop iterations/s with publishing / without     (1.0: no cost)

    python benchmarks/overlap_bench.py --gil [--prompt 8192] [--rounds 12] [--io-threads 1]

On a machine with fewer free cores than threads this also counts plain CPU
contention; the same-run ratios between paths are the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time

import torch

from disagg.engine.async_engine import AsyncEngine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.engine import EngineOptions, ReferenceEngine
from disagg.engine.reference.model import K3ForCausalLM
from disagg.messages import GenerateParams
from disagg.workers.tiered import StatefulWorker
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (n,), generator=g).tolist()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def _round(workers: dict[str, StatefulWorker], engine: AsyncEngine, prompts: list[list[int]], mode: str,
                 tag: str):
    """(prefill makespan, total makespan) of one round in ``mode`` (off / on / node / hold / export)."""
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    done: list[float] = []

    async def one(i: int, p: list[int]) -> None:
        rid = f"{tag}-{i}"
        if mode in workers:
            handle = await workers[mode].prefill(GenerateParams(rid, p, sp))
            done.append(handle.prefill_seconds)  # from the call's start (all start at t0) to the first token
            return
        async for _ in engine.generate(EngineRequest(rid, p, sp, keep_state=mode != "off")):
            pass
        done.append(time.perf_counter() - t0)
        if mode == "export":
            await engine.export_state(rid, len(p), 0)
        if mode != "off":
            await engine.release(rid, keep_resident=False)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return max(done), time.perf_counter() - t0


async def run(args) -> dict:
    model = K3ForCausalLM.random_init(load_preset(args.preset), seed=0, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    opts = EngineOptions(block_size=64, max_num_seqs=max(16, args.batch), max_num_batched_tokens=args.chunk,
                         cache_budget_bytes=args.budget_mb << 20, resident_sessions=False)
    engine = AsyncEngine(ReferenceEngine(model, "bench", opts))
    state_bytes = engine.layout.mla_block_bytes() * (args.prompt // 64 + 1) + engine.layout.kda_checkpoint_bytes()
    host = HostTier(max(512 << 20, 3 * args.batch * state_bytes), pin_memory=args.device.startswith("cuda"))
    modes = ["off"] + [m for m in args.modes.split(",") if m and m != "off"]
    workers = {"on": StatefulWorker(engine, StateStore([host], engine.layout), "prefill-0", "local")}
    node = None
    if "node" in modes:  # the node's store process: a child owning the tier, this process its client
        node = _NodeStore(host.capacity_bytes)
        workers["node"] = StatefulWorker(engine, StateStore([node.client], engine.layout), "prefill-1", "local")
    for i, mode in enumerate(modes):  # kernels compiled / autotuned, staging buffers cached
        await _round(workers, engine, [_ids(args.prompt, 1 + i)], mode, f"warm-{mode}")
    prefill: dict[str, list[float]] = {m: [] for m in modes}
    total: dict[str, list[float]] = {m: [] for m in modes}
    seed = 100
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:  # the order rotates per round
            prompts = [_ids(args.prompt, seed + i) for i in range(args.batch)]
            seed += args.batch
            _sync(args.device)
            p, t = await _round(workers, engine, prompts, mode, f"{mode}{r}")
            prefill[mode].append(p)
            total[mode].append(t)
            if mode in workers:  # what was published resumes to the prompt's full length
                w = workers[mode]
                for q in prompts:
                    got = w.store.resumable_length(q, w.hasher, len(q)).position
                    assert got == len(q), f"published state resumes at {got}, not {len(q)}"
            print(f"round {r} {mode:>6}: prefill {p * 1000:9.1f} ms  total {t * 1000:9.1f} ms", flush=True)
    engine.shutdown()
    if node is not None:
        node.close()
    med_p = {k: statistics.median(v) for k, v in prefill.items()}
    med_t = {k: statistics.median(v) for k, v in total.items()}
    out = {"device": args.device, "preset": args.preset, "prompt_tokens": args.prompt, "batch": args.batch,
           "rounds": args.rounds, "modes": modes,
           "prefill_makespan_ms": {k: 1000 * v for k, v in med_p.items()},
           "total_makespan_ms": {k: 1000 * v for k, v in med_t.items()},
           "prefill_ratio_vs_off": {k: v / med_p["off"] for k, v in med_p.items()},
           "total_ratio_vs_off": {k: v / med_t["off"] for k, v in med_t.items()},
           "published_bytes": {k: w.counters["published_bytes"] for k, w in workers.items()},
           "gil_switch_interval_s": sys.getswitchinterval(),
           "prefill_tok_s": {k: args.batch * args.prompt / v for k, v in med_p.items()}}
    # paired: each round holds every mode once, so round r's ratio to its own off cancels slow drifts
    for name, times in (("prefill", prefill), ("total", total)):
        ratios = {k: sorted(a / b for a, b in zip(v, times["off"], strict=True)) for k, v in times.items() if k != "off"}
        out[f"{name}_paired_ratio"] = {k: statistics.median(v) for k, v in ratios.items()}
        out[f"{name}_paired_quartiles"] = {k: [v[len(v) // 4], v[(3 * len(v)) // 4]] for k, v in ratios.items()}
    out["off_spread"] = [1000 * min(prefill["off"]), 1000 * max(prefill["off"])]
    if "on" in modes:  # the names the earlier runs' JSON used
        out.update(makespan_off_ms=1000 * med_t["off"], makespan_on_ms=1000 * med_t["on"],
                   ratio_on_off=med_t["on"] / med_t["off"], prefill_ratio_on_off=med_p["on"] / med_p["off"])
    print(json.dumps(out, indent=2))
    return out


class _NodeStore:
    """A child process owning a host tier of ``capacity`` bytes (the node's store process), and
    this process's client of it."""

    def __init__(self, capacity: int):
        import multiprocessing as mp

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from kv_transfer_bench import _serve_host

        from kv_transfer.tiers.host_ipc import HostTierClient

        ctx = mp.get_context("spawn")
        self._pipe, there = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_host, args=(capacity, there), daemon=True)
        self._proc.start()
        self.client = HostTierClient(self._pipe.recv())

    def close(self) -> None:
        self.client.close()
        self._pipe.send("stop")
        self._proc.join(timeout=10)


def _spin(window: float) -> float:
    """Iterations per second of a pure-Python loop over ``window`` seconds (holds the GIL)."""
    n, t0 = 0, time.perf_counter()
    while True:
        x = 0
        for i in range(200):
            x += i
        n += 1
        t = time.perf_counter() - t0
        if t >= window:
            return n / t


def gil_probe(args) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kv_transfer_bench import _PerObject, _small_layout, _state

    from kv_transfer import codec
    from kv_transfer.keys import BlockHasher, KeyExtras

    try:
        from kv_transfer import checksum
    except ImportError:
        checksum = None
    if not hasattr(codec, "block_codec"):  # an older tree: its one path only
        checksum = None
    layout = _small_layout()
    state = _state(layout, args.prompt)
    nbytes = state.mla_rows.nbytes + state.kda[0].conv.nbytes + state.kda[0].recurrent.nbytes
    tokens = list(range(3, 3 + args.prompt))
    hasher = BlockHasher(layout.block_size, KeyExtras(layout.model_id))
    tier = HostTier(max(256 << 20, 3 * nbytes), prefault=True)
    paths = [("default", True, None)]
    if checksum is not None:
        paths = [("batched crc32c", True, checksum.CRC32C), ("batched crc32", True, checksum.CRC32),
                 ("per-object crc32", False, checksum.CRC32)]
        if checksum.WRITE_ALGO != checksum.CRC32C:
            paths = paths[1:]
    node = None
    if checksum is not None and hasattr(checksum, "seal"):  # the node's store process seals what its client put
        node = _NodeStore(tier.capacity_bytes)
        paths.insert(1, ("node, sealed there", True, checksum.CRC32C))
    node_client = node.client if node is not None else None
    period = nbytes / (args.publish_mb_s * 1e6)  # seconds per state at the target rate

    class Publisher(threading.Thread):
        """Puts states at the target rate while ``go`` is set; ``idle`` is set between puts."""

        def __init__(self, store: StateStore):
            super().__init__(daemon=True)
            self.store, self.go, self.idle, self.stop, self.num_bytes = store, threading.Event(), \
                threading.Event(), False, 0
            self.count = 0

        def run(self) -> None:
            while not self.stop:
                self.idle.set()
                if not self.go.wait(0.05):
                    continue
                self.idle.clear()
                t0 = time.perf_counter()
                if self.store.tiers[0] is node_client:  # new keys each time: the node's tier evicts in its process
                    self.count += 1
                    put = self.store.put_state(tokens, state, hasher.with_salt(str(self.count)))
                else:
                    put = self.store.put_state(tokens, state, hasher)
                    for key in put.keys_stored:
                        tier.delete(key)
                self.num_bytes += put.bytes_stored
                self.idle.set()
                time.sleep(max(0.0, period - (time.perf_counter() - t0)))

    out_progress: dict[str, float] = {}
    out_rate: dict[str, float] = {}
    write_algo = checksum.WRITE_ALGO if checksum is not None else None
    try:
        for name, batched, algo in paths:
            if algo is not None:
                checksum.WRITE_ALGO = algo
                codec.block_codec.cache_clear()
            first = node_client if name.startswith("node") else tier if batched else _PerObject(tier)
            pub = Publisher(StateStore([first], layout, io_threads=args.io_threads))
            pub.start()
            ratios, on_time = [], 0.0
            for _ in range(args.rounds):  # adjacent off / on windows: slow drifts of the machine cancel
                pub.go.clear()
                pub.idle.wait()
                off = _spin(args.window)
                t0 = time.perf_counter()
                pub.go.set()
                on = _spin(args.window)
                pub.go.clear()
                pub.idle.wait()
                on_time += time.perf_counter() - t0
                ratios.append(on / off)
            pub.stop = True
            pub.join()
            out_progress[name] = statistics.median(ratios)
            out_rate[name] = pub.num_bytes / on_time / 1e6
            print(f"{name:<18} progress {out_progress[name]:.3f} (pairs: {min(ratios):.2f}-{max(ratios):.2f})  "
                  f"published {out_rate[name]:.0f} MB/s", flush=True)
    finally:
        if checksum is not None:
            checksum.WRITE_ALGO = write_algo
            codec.block_codec.cache_clear()
        tier.close()
        if node is not None:
            node.close()
    out = {"prompt_tokens": args.prompt, "state_mb": nbytes / 1e6, "io_threads": args.io_threads,
           "target_mb_s": args.publish_mb_s, "window_s": args.window, "pairs": args.rounds,
           "switch_interval_s": sys.getswitchinterval(), "progress": out_progress, "published_mb_s": out_rate}
    # what publishing costs the stepping thread per GB published (a path that falls behind the
    # target rate publishes less per window, so progress alone would flatter it)
    out["thread_s_lost_per_gb"] = {k: (1 - out_progress[k]) / max(out_rate[k] / 1e3, 1e-9) for k in out_progress}
    print(json.dumps(out, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--budget-mb", type=int, default=1024)
    ap.add_argument("--modes", default="off,on", help="comma list of off, on, node, hold, export")
    ap.add_argument("--json")
    ap.add_argument("--gil", action="store_true", help="run the GIL probe (no model) instead")
    ap.add_argument("--window", type=float, default=0.5, help="--gil: seconds per measured window")
    ap.add_argument("--io-threads", type=int, default=1, help="--gil: the store's I/O threads")
    ap.add_argument("--publish-mb-s", type=float, default=225.0, help="--gil: publishing rate")
    args = ap.parse_args()
    if args.gil:
        sys.setswitchinterval(0.0005)  # what the engines set (engine NOTE 4)
    out = gil_probe(args) if args.gil else asyncio.run(run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
