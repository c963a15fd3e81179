"""Device <-> pinned host state copies against one large pinned copy (same run).

    python benchmarks/gpu_transfer_bench.py [--json out.json]

K3-like per-GPU shapes (TP8): 24 MLA layers of [num_blocks, 256, 576] bf16
pages, 69 KDA layers of per-rank state slots (4 heads of 128x128 fp32 + conv).
Measures ``kv_transfer.device`` gather (device -> pinned host) and scatter
(pinned host -> device) of randomly placed blocks / slots, the same bytes as
one contiguous pinned copy each way (the ceiling), and a per-block copy loop
(the anti-pattern) for scale. Checks the round trip bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kv_transfer.device import (
    alloc_staging,
    gather_blocks,
    gather_slots,
    scatter_blocks,
    scatter_slots,
)


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ceiling(nbytes: int, reps: int) -> tuple[float, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = alloc_staging((nbytes,), torch.uint8)
    d2h = _time(lambda: host.copy_(dev, non_blocking=True), reps)
    h2d = _time(lambda: dev.copy_(host, non_blocking=True), reps)
    return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def mla(args) -> dict:
    layers = [torch.randn(args.pool_blocks, args.block_size, 576, device="cuda").to(torch.bfloat16)
              for _ in range(args.mla_layers)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(args.pool_blocks, generator=g)[: args.blocks].tolist()
    staging = alloc_staging((args.mla_layers, args.blocks * args.block_size, 576), torch.bfloat16)
    nbytes = staging.numel() * staging.element_size()
    stream = torch.cuda.Stream()
    gather_s = _time(lambda: gather_blocks(layers, ids, out=staging, stream=stream)[1].wait(), args.reps)
    ref = torch.stack([layer[ids] for layer in layers]).reshape(staging.shape).cpu()
    exact_gather = torch.equal(staging, ref)
    targets = torch.randperm(args.pool_blocks, generator=g)[: args.blocks].tolist()
    scatter_s = _time(lambda: scatter_blocks(staging, layers, targets, stream=stream).wait(), args.reps)
    exact_scatter = all(torch.equal(layers[i][targets].cpu().reshape(-1, 576), staging[i]) for i in (0, len(layers) - 1))
    small = ids[: min(64, len(ids))]
    one = alloc_staging((args.block_size, 576), torch.bfloat16)

    def per_block():
        for layer in layers:
            for b in small:
                one.copy_(layer[b], non_blocking=True)

    loop_s = _time(per_block, max(1, args.reps // 2))
    loop_bytes = len(small) * len(layers) * args.block_size * 576 * 2
    d2h, h2d = _ceiling(nbytes, args.reps)
    return {"bytes": nbytes, "blocks": args.blocks, "layers": args.mla_layers,
            "gather_GBps": nbytes / gather_s / 1e9, "scatter_GBps": nbytes / scatter_s / 1e9,
            "ceiling_d2h_GBps": d2h, "ceiling_h2d_GBps": h2d,
            "gather_vs_ceiling": nbytes / gather_s / 1e9 / d2h, "scatter_vs_ceiling": nbytes / scatter_s / 1e9 / h2d,
            "per_block_loop_GBps": loop_bytes / loop_s / 1e9, "bit_exact": exact_gather and exact_scatter}


def kda(args) -> dict:
    h, d = args.kda_heads, 128
    # slot pools stacked over layers ([layers, slots, ...]): one gather kernel per layer group
    rec = torch.randn(args.kda_layers, args.pool_slots, h, d, d, device="cuda")
    conv = torch.randn(args.kda_layers, args.pool_slots, 3, 3 * h * d, device="cuda").to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(args.pool_slots, generator=g)[: args.slots].tolist()
    st_rec = alloc_staging((args.kda_layers, args.slots, h, d, d), torch.float32)
    st_conv = alloc_staging((args.kda_layers, args.slots, 3, 3 * h * d), torch.bfloat16)
    nbytes = st_rec.numel() * 4 + st_conv.numel() * 2
    stream = torch.cuda.Stream()

    def gather():
        a = gather_slots(rec, ids, out=st_rec, stream=stream)[1]
        b = gather_slots(conv, ids, out=st_conv, stream=stream)[1]
        a.wait()
        b.wait()

    def scatter():
        scatter_slots(st_rec, rec, ids, stream=stream).wait()
        scatter_slots(st_conv, conv, ids, stream=stream).wait()

    gather_s = _time(gather, args.reps)
    exact = torch.equal(st_rec[0], rec[0][ids].cpu())
    scatter_s = _time(scatter, args.reps)
    d2h, h2d = _ceiling(nbytes, args.reps)
    return {"bytes": nbytes, "slots": args.slots, "layers": args.kda_layers,
            "gather_GBps": nbytes / gather_s / 1e9, "scatter_GBps": nbytes / scatter_s / 1e9,
            "ceiling_d2h_GBps": d2h, "ceiling_h2d_GBps": h2d,
            "gather_vs_ceiling": nbytes / gather_s / 1e9 / d2h, "scatter_vs_ceiling": nbytes / scatter_s / 1e9 / h2d,
            "bit_exact": exact}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mla-layers", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--pool-blocks", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=128, help="blocks moved (128 x 256 = 32K tokens)")
    ap.add_argument("--kda-layers", type=int, default=69)
    ap.add_argument("--kda-heads", type=int, default=4, help="KDA heads per TP rank")
    ap.add_argument("--pool-slots", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "mla": mla(args), "kda": kda(args)}
    for part in ("mla", "kda"):
        r = out[part]
        print(f"{part}: {r['bytes'] / 1e6:.0f} MB  gather {r['gather_GBps']:.1f} GB/s "
              f"({r['gather_vs_ceiling']:.2f} of {r['ceiling_d2h_GBps']:.1f})  scatter {r['scatter_GBps']:.1f} GB/s "
              f"({r['scatter_vs_ceiling']:.2f} of {r['ceiling_h2d_GBps']:.1f})  exact={r['bit_exact']}", flush=True)
    print(f"per-block copy loop: {out['mla']['per_block_loop_GBps']:.2f} GB/s")
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
