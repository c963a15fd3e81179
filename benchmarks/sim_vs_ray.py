"""The simulator against the real system: same trace, same router, tiny model, one local Ray cluster.

    python benchmarks/sim_vs_ray.py --out results/sim_vs_ray [--concurrency 1,2,4] [--requests 40]

1. Serves the embedded default (``deployments/configs/local-cpu.yaml``: one
   prefill + one decode replica of the tiny model, a shared host tier) on a
   local Ray cluster.
2. Times the reference engine alone (``disagg sim calibrate --engine tiny``:
   one torch thread, as a replica runs it) inside a Ray worker of that
   cluster (``--engine-timing ray``, the default: the replicas' process
   settings, e.g. Ray's worker niceness, on the machine as it is loaded
   now), or in this process (``--engine-timing here``).
3. Replays the CPU-sized agentic trace of ``benchmarks/e2e_pareto.py`` with
   ``disagg bench``: first the calibration runs (``--calibrate-concurrency``,
   default c1 and c4, salts of their own), then the validation sweep
   (``--concurrency``, new salts).
4. Fits the serving path's overheads and the engine's in-replica slowdown
   from the c1 calibration run (``disagg sim calibrate --from-bench``), then
   the node's compute slots (how much the replicas and everything else on
   the machine slow each other: ``ClusterConfig.node_compute_slots``) as the
   value whose simulated tok/s/GPU matches the calibration runs above c1.
5. Replays the validation sweep in the simulator: the same trace, the same
   closed-loop settings (lanes, think time, warm-up, start turns, salts, the
   benchmark's own ``RunConfig``s), the same router policy and P/D decider
   threshold, the same checkpoint positions (prompt ends and the prompt's last
   block boundary: the engine's aligned checkpoints) and tier sizes.
6. Prints, per concurrency, real vs simulated TTFT (mean, P50, P90), ITL
   P90, total tok/s/GPU and cache hit, with sim / real ratios; the goal is
   TTFT and throughput within 15%; and the real system against itself: the
   calibration runs and the validation runs at the same concurrency replay the
   same requests (other salts), so their ratio is the noise floor of the
   comparison.
7. Bootstrap 90% intervals (``--bootstrap`` resamples of the measured
   requests) of the real TTFT mean, P50 and P90, and of their sim / real
   ratios (over the requests both ran, the same session and turn, resampled
   as pairs: the closed loops of the two drift apart, so a few differ); and
   per run the TTFT of the two kinds of request the distribution is made
   of: cache hits whose uncached suffix the decode replica prefills (<= the
   decider's threshold) and remote prefills. When about half the requests
   are hits the TTFT P50 falls at the boundary of the two, and moves with
   one request changing side; the intervals show by how much.
   ``comparison.json`` holds every measured request, real and simulated.

The CPU is shared: the real runs' absolute times move with the machine's
load (printed with the results); the calibration comes from the same
machine and the same session of the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
from e2e_pareto import CONFIG, FIRST_TOKEN_ID, VOCAB_SIZE, cpu_trace, engine_replicas, warm_up

from disagg.config import load_config
from disagg.costs.profile import EngineProfile, load_profile
from disagg.launch.local import free_port, local_app, wait_healthy
from disagg.tools.bench.report import load_requests, load_sweep
from disagg.tools.bench.sweep import BenchParams, run_bench_sync
from disagg.tools.bench.tokens import shared_hash_ids
from disagg.tools.bench.trace import save_trace
from disagg.tools.sim.calibrate import from_bench_runs, time_engine
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.simulator import ClusterConfig, Simulator
from disagg.tools.sim.workload import from_trace_records

METRICS = [("TTFT mean ms", lambda s: s["ttft_ms"]["mean"]), ("TTFT P50 ms", lambda s: s["ttft_ms"]["p50"]),
           ("TTFT P90 ms", lambda s: s["ttft_ms"]["p90"]), ("ITL P90 ms", lambda s: s["itl_ms"]["p90"]),
           ("tok/s/GPU", lambda s: s["total_tps_per_gpu"]), ("cache hit", lambda s: s["cache_hit_usage"] or 0.0)]
GATED = ("TTFT mean ms", "TTFT P50 ms", "tok/s/GPU")
TTFT_STATS = {"TTFT mean ms": lambda x: np.mean(x, axis=-1),  # per-request figures (bootstrapped), of rows
              "TTFT P50 ms": lambda x: np.percentile(x, 50, axis=-1),
              "TTFT P90 ms": lambda x: np.percentile(x, 90, axis=-1)}


def _time_engine_task(threads: int) -> dict:
    return time_engine("tiny", threads=threads, progress=False).to_dict()


def time_engine_in_ray(threads: int = 1) -> EngineProfile:
    """``time_engine`` in a Ray worker of the running cluster (as the replicas run: same process settings)."""
    import ray

    task = ray.remote(num_cpus=0)(_time_engine_task)
    prof = EngineProfile.from_dict(ray.get(task.remote(threads)))
    prof.source["command"] += " (in a Ray worker of the serving cluster, by benchmarks/sim_vs_ray.py)"
    return prof


@contextlib.contextmanager
def serving(cfg, attempts: int = 4):
    """``local_app`` that tries again when Ray's node does not start in time (a busy shared machine)."""
    for k in range(attempts):
        cm = local_app(cfg)
        try:
            url = cm.__enter__()
        except Exception as exc:
            if k + 1 == attempts or "timed out during startup" not in str(exc):
                raise
            import ray

            ray.shutdown()
            print(f"Ray did not start ({exc}); trying again", file=sys.stderr, flush=True)
            time.sleep(15)
            continue
        break
    try:
        yield url
    finally:
        cm.__exit__(None, None, None)


def params(url: str, trace: Path, out: Path, conc: list[int], salt: int, num_gpus: int, args) -> BenchParams:
    return BenchParams(url=url, trace=str(trace), out=str(out), concurrency=conc, max_requests=args.requests,
                       think_cap_ms=args.think_cap_ms, think_scale=args.think_scale, sample_start_turn=True,
                       salt=salt, seed=args.seed, num_gpus=num_gpus, vocab_size=VOCAB_SIZE,
                       first_token_id=FIRST_TOKEN_ID, default_block_size=64, progress=not args.quiet, quiet=args.quiet,
                       plots=False)


def sim_cluster(cfg, prof: EngineProfile) -> ClusterConfig:
    """The served stack as a simulated cluster: tier sizes in 64-token blocks of the tiny model."""
    from disagg.engine.factory import build_reference_engine

    geo = build_reference_engine(cfg).geometry
    block_bytes = cfg.engine.block_size * prof.state["bytes_per_token"]
    host_blocks = int(cfg.transfer.host.capacity_mb * 2**20 // block_bytes)
    d = cfg.deployment
    return ClusterConfig(num_prefill=d.prefill.num_replicas, num_decode=d.decode.num_replicas, workers_per_node=8,
                         device_blocks=int(geo.num_blocks), host_blocks=host_blocks,
                         checkpoint_every_blocks=cfg.engine.checkpoint_interval // cfg.engine.block_size,
                         checkpoint_last_full_block=True, checkpoint_prompt_end=True,  # the engine's NOTE 5
                         node_compute_slots=float(prof.limits.get("node_compute_slots", 0.0)))


def simulate_sweep(records, bp: BenchParams, cluster: ClusterConfig, prof: EngineProfile, cfg,
                   requests: dict[str, list[dict]] | None = None) -> dict[str, dict]:
    """Simulated bench summaries per run label; ``requests`` (if given) gets the measured requests of each."""
    reqs = from_trace_records(records, 64)
    shared = shared_hash_ids(records)
    router = {"decider": cfg.router.decider_params()}
    out = {}
    for rc in bp.run_configs():
        sim = Simulator(reqs, "state_aware", cluster, prof.cost_model(), replay=ReplayConfig.from_run_config(rc),
                        router_config=router, shared_ids=shared)
        res = sim.run()
        out[rc.label] = res.bench_summary().to_dict()
        if requests is not None:
            requests[rc.label] = [
                {"session_id": r.session_id, "turn": r.turn, "send_s": round(r.arrival, 6),
                 "ttft_ms": round(1e3 * r.ttft, 3), "prompt_tokens": r.prompt_len, "cached_tokens": r.cached_tokens,
                 "prefill_worker": r.prefill_worker, "decode_worker": r.decode_worker}
                for r in res.records if not r.warmup and r.finish >= 0]
    return out


def real_requests(sweep_dir: Path) -> dict[str, list[dict]]:
    """The measured, successful requests of each run of a bench sweep (the benchmark's own selection)."""
    out = {}
    for e in load_sweep(sweep_dir)["runs"]:
        rows = load_requests(sweep_dir / "runs" / e["label"])
        out[e["label"]] = [{k: r[k] for k in ("session_id", "turn", "send_s", "ttft_ms", "prompt_tokens",
                                              "cached_tokens")}
                           for r in rows if not r["warmup"] and r["error"] is None]
    return out


def bootstrap(real: list[dict], sim: list[dict], stat, n: int, seed: int = 0):
    """90% intervals of stat(real TTFT) (its requests resampled) and of stat(sim) / stat(real) over the requests
    both ran (the same session and turn), resampled as pairs; and how many pairs there were."""
    rng = np.random.default_rng(seed)
    a = np.asarray([r["ttft_ms"] for r in real], dtype=np.float64)
    lo, hi = np.percentile(stat(a[rng.integers(0, len(a), (n, len(a)))]), [5, 95])
    sims = {(r["session_id"], r["turn"]): r["ttft_ms"] for r in sim}
    pairs = np.asarray([(r["ttft_ms"], sims[k]) for r in real if (k := (r["session_id"], r["turn"])) in sims],
                       dtype=np.float64).reshape(-1, 2)
    if len(pairs) < 2:
        return (float(lo), float(hi)), (float("nan"), float("nan")), len(pairs)
    idx = rng.integers(0, len(pairs), (n, len(pairs)))
    rlo, rhi = np.percentile(stat(pairs[idx, 1]) / stat(pairs[idx, 0]), [5, 95])
    return (float(lo), float(hi)), (float(rlo), float(rhi)), len(pairs)


def split_line(label: str, real: list[dict], sim: list[dict], threshold: int) -> str:
    """TTFT of hits prefilled by the decode replica (uncached suffix <= threshold) and of remote prefills."""
    def part(rows):
        hit = [r["ttft_ms"] for r in rows if r["prompt_tokens"] - r["cached_tokens"] <= threshold]
        miss = [r["ttft_ms"] for r in rows if r["prompt_tokens"] - r["cached_tokens"] > threshold]
        f = lambda xs: f"{np.mean(xs):,.0f} / {np.median(xs):,.0f} / {max(xs):,.0f}" if xs else "-"
        return f"{len(hit)} hits {f(hit)}, {len(miss)} remote {f(miss)}"
    return f"- {label}: real {part(real)}; simulated {part(sim)}"


SLOTS_GRID = [round(0.3 + 0.05 * i, 2) for i in range(35)]  # 0.3 .. 2.0


def fit_slots(records, cal: BenchParams, real: dict[str, dict], cfg, prof: EngineProfile) -> tuple[float, float]:
    """The node_compute_slots whose simulated tok/s/GPU best matches the calibration runs above c1: (slots, error)."""
    import dataclasses

    runs = [rc for rc in cal.run_configs() if rc.concurrency > 1 and rc.label in real]
    if not runs:
        return float(prof.limits.get("node_compute_slots", 0.0)), float("nan")
    best = (0.0, float("inf"))
    for slots in SLOTS_GRID:
        cluster = dataclasses.replace(sim_cluster(cfg, prof), node_compute_slots=slots)
        sim = simulate_sweep(records, cal, cluster, prof, cfg)
        err = sum(abs(sim[rc.label]["total_tps_per_gpu"] / real[rc.label]["total_tps_per_gpu"] - 1)
                  for rc in runs) / len(runs)
        if err < best[1]:
            best = (slots, err)
    return best


def noise_floor(cal_real: dict[str, dict], real: dict[str, dict], requests: int) -> str:
    """The same requests twice at each concurrency of both sweeps (calibration, then validation): real / real."""
    lines = []
    for label in [x for x in real if x in cal_real]:
        a, b = cal_real[label], real[label]
        parts = [f"{name} {get(b) / get(a):.2f}" for name, get in METRICS if name in GATED and get(a)]
        lines.append(f"- {label}: " + ", ".join(parts))
    if not lines:
        return ""
    return (f"the real system against itself (the same {requests} requests, calibration run -> validation run):\n"
            + "\n".join(lines))


def compare(real: dict[str, dict], sim: dict[str, dict], real_reqs: dict[str, list[dict]] | None = None,
            sim_reqs: dict[str, list[dict]] | None = None, resamples: int = 0) -> tuple[str, list[dict]]:
    """The table; TTFT figures get bootstrap 90% intervals when the requests are given (``resamples`` > 0)."""
    lines = ["| run | metric | real | simulated | sim / real | real, 90% interval | sim / real, 90% interval (pairs) |",
             "|---|---|---|---|---|---|---|"]
    rows = []
    for label, r in real.items():
        s = sim[label]
        for name, get in METRICS:
            a, b = get(r), get(s)
            ratio = b / a if a else float("nan")
            ok = abs(ratio - 1) <= 0.15 if name in GATED else None
            row = {"run": label, "metric": name, "real": a, "sim": b, "ratio": ratio, "within_15pct": ok}
            ci = ""
            if (resamples and name in TTFT_STATS and real_reqs and sim_reqs and real_reqs.get(label)
                    and sim_reqs.get(label)):
                (lo, hi), (rlo, rhi), npairs = bootstrap(real_reqs[label], sim_reqs[label], TTFT_STATS[name],
                                                         resamples)
                row.update(real_90=[lo, hi], ratio_90=[rlo, rhi], pairs=npairs)
                ci = f" {lo:,.1f} - {hi:,.1f} | {rlo:.2f} - {rhi:.2f} ({npairs}) |"
            rows.append(row)
            flag = "" if ok is None else (" ok" if ok else " **off**")
            spec = ".3f" if name == "cache hit" else ",.1f"
            lines.append(f"| {label} | {name} | {a:{spec}} | {b:{spec}} | {ratio:.2f}{flag} |{ci or ' | |'}")
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/sim_vs_ray")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--calibrate-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                    help="calibration runs: c1 (overheads, slowdowns) and higher ones (the node's compute slots)")
    ap.add_argument("--requests", type=int, default=40, help="measured requests per run")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--think-cap-ms", type=float, default=2000.0)
    ap.add_argument("--think-scale", type=float, default=0.05)
    ap.add_argument("--base", help="engine profile to start from (default: time the engine now)")
    ap.add_argument("--engine-timing", choices=["ray", "here"], default="ray",
                    help="time the engine in a Ray worker of the serving cluster, or in this process")
    ap.add_argument("--save-profile", help="also write the engine timing here (e.g. disagg/costs/profiles/cpu-tiny.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bootstrap", type=int, default=4000, help="resamples for the 90%% intervals (0: none)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--analyze-only", action="store_true",
                    help="no serving: refit and re-simulate from a previous run's --out")
    args = ap.parse_args(argv)
    if 1 not in args.calibrate_concurrency:
        ap.error("--calibrate-concurrency needs a c1 run (the serving overheads are fitted from it)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    load = [os.getloadavg()[0]]
    records = cpu_trace(args.sessions, args.seed)
    trace = out / "trace.jsonl"
    cfg = load_config(CONFIG)
    cfg.http.port = free_port()
    gpus = engine_replicas(cfg)
    val = params("http://unused", trace, out / "validation", args.concurrency, 11, gpus, args)
    if args.analyze_only:
        base = load_profile(out / "engine_profile.json")
        real_doc = load_sweep(out / "validation")
        prev = json.loads((out / "comparison.json").read_text()) if (out / "comparison.json").exists() else {}
        load = prev.get("load_avg", load)
        run_s = prev.get("run_s", prev.get("elapsed_s"))  # the serving run's total, not this re-analysis
    else:
        base = load_profile(args.base) if args.base else None
        if base is None and args.engine_timing == "here":
            base = time_engine("tiny", threads=1, progress=not args.quiet)
        save_trace(records, trace)
        os.environ.setdefault("RAY_ADDRESS", "local")  # a cluster of its own, even where another one runs
        with serving(cfg) as url:
            wait_healthy(url)
            warm_up(url, cfg.model.openai_name)
            if base is None:
                print("timing the engine in a Ray worker ...", file=sys.stderr, flush=True)
                base = time_engine_in_ray(cfg.engine.num_threads or 1)
            base.save(out / "engine_profile.json")
            if args.save_profile:
                base.save(args.save_profile)
            load.append(os.getloadavg()[0])
            cal = params(url, trace, out / "calibration", args.calibrate_concurrency, 1, gpus, args)
            run_bench_sync(cal, records)
            val.url = url
            real_doc = run_bench_sync(val, records)
            load.append(os.getloadavg()[0])
    cal = params("http://unused", trace, out / "calibration", args.calibrate_concurrency, 1, gpus, args)
    fitted = from_bench_runs([out / "calibration" / "runs" / "c1"], base, cfg.router.local_prefill_max_tokens,
                             name="cpu-tiny-served")
    cal_real = {e["label"]: e["summary"] for e in load_sweep(out / "calibration")["runs"]}
    slots, slots_err = fit_slots(records, cal, cal_real, cfg, fitted)
    if not math.isnan(slots_err):  # fitted from runs above c1
        fitted.limits["node_compute_slots"] = slots
        fitted.source["notes"].append(f"node_compute_slots {slots:.2f} (timed alone: "
                                      f"{base.limits.get('node_compute_slots', 0.0):.2f}) from the calibration runs "
                                      f"above c1 (tok/s/GPU off by {100 * slots_err:.1f}% there)")
    fitted.save(out / "fitted_profile.json")
    real = {e["label"]: e["summary"] for e in real_doc["runs"]}
    sim_reqs: dict[str, list[dict]] = {}
    sim = simulate_sweep(records, val, sim_cluster(cfg, fitted), fitted, cfg, sim_reqs)
    real_reqs = real_requests(out / "validation")
    table, rows = compare(real, sim, real_reqs, sim_reqs, args.bootstrap)
    threshold = cfg.router.local_prefill_max_tokens
    split = "\n".join(split_line(label, real_reqs[label], sim_reqs[label], threshold)
                      for label in real if label in real_reqs and label in sim_reqs)
    elapsed = time.monotonic() - t0
    if not args.analyze_only:
        run_s = elapsed
    total = f"total {run_s:.0f} s" if run_s is not None else "total unknown"
    if args.analyze_only:
        total += f" (re-analysed with --analyze-only in {elapsed:.0f} s)"
    notes = "\n".join(f"- {n}" for n in fitted.source["notes"])
    cal_label = ", ".join(f"c{c}" for c in args.calibrate_concurrency)
    text = (f"{table}\n\nTTFT ms (mean / median / max) of cache hits (uncached suffix <= {threshold} tokens, "
            f"prefilled by the decode replica) and remote prefills:\n{split}\n\n"
            f"{noise_floor(cal_real, real, args.requests)}\n\ncalibration ({cal_label}, salts of their own):\n{notes}\n\n"
            f"load average (1 min) at start / serving / end: {', '.join(f'{x:.1f}' for x in load)}; "
            f"{total}\n")
    print(text)
    (out / "table.md").write_text(text)
    (out / "comparison.json").write_text(json.dumps({"rows": rows, "load_avg": load, "elapsed_s": round(elapsed, 1),
                                                     "run_s": None if run_s is None else round(run_s, 1),
                                                     "real": real, "sim": sim, "real_requests": real_reqs,
                                                     "sim_requests": sim_reqs}, indent=2, default=str))
    gated = [r for r in rows if r["within_15pct"] is not None]
    print(f"{sum(r['within_15pct'] for r in gated)}/{len(gated)} gated figures within 15%", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
