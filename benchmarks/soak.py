"""Bounded soak: concurrent synthetic agentic sessions against the whole Ray Serve app on this
machine, with faults injected at a set rate, bad inputs mixed in and the HTTP edge under attack;
an accounting at the end.

    python benchmarks/soak.py [--minutes 10] [--sessions 32] [--transfer-fault-rate 0.03]
                              [--kill-rate 0.01] [--bad-input-rate 0.05] [--out docs/reliability]
                              [--slow-bodies 200] [--header-trickles 100] [--abandon-every-s 10]
                              [--burst-every-s 60] [--burst-size 200] [--port 0]

The attacks (benchmarks/soak_attacks.py, from 127.0.0.2): slow request bodies, header trickle,
abandoned non-streamed requests, overload bursts, and a /health probe from 127.0.0.1. The gate
runs 48 generations and queues 48, so a burst is partly shed (503 + Retry-After).

The app: the embedded default (deployments/configs/local-cpu.yaml: the reference model on CPU)
with 2 decode and 1 prefill replicas, two API keys (sessions alternate between them), a 64 MiB
host tier and these fault rules, each decided per event on the replica serving it:

    kill_decode   --kill-rate of decode requests: the replica exits after 2 streamed tokens
    kill_prefill  --kill-rate of prefill calls: the replica exits
    drop / delay / corrupt   --transfer-fault-rate of state loads each (delay: 10 s, deadline 2 s)

A session: a prefix shared by every session, then 200-400 tokens of its own; each turn streams
8-24 greedy tokens (ignore_eos, so exactly max_tokens), appends them and a 20-120 token tool
result, and starts over past 1,536 tokens. With --bad-input-rate a turn is preceded by one bad
request (no or wrong key, unknown model, malformed JSON, NaN, out-of-vocabulary ids, context
overflow, oversize body, an image part); each must get its 4xx as an OpenAI error.

Reported (printed, and written to OUT/soak.json with OUT/soak.png):
- requests served in full; 4xx, shed (429/503, retried after Retry-After), 5xx (goal 0);
- tokens lost (goal 0): tokens a request asked for and did not get, whatever the reason; among
  the failures, streams that ended with an explicit 503 ``stream_resume_timeout`` (no decode
  replica took them back within ``deployment.stream_resume_timeout_s``);
- outputs compared with the uninterrupted run (the reference engine in this process), for every
  request that met a fault and a random sample of the rest: mismatches (goal 0);
- faults injected by kind (the ledger the replicas append to, which outlives killed replicas),
  and survived: the request that met the fault was served in full (and matched, where compared);
- the attacks' accounting (soak_attacks.AttackTally), 5xx other than 503 (goal 0), abandoned
  requests still running 10 s after their clients left (goal 0), /health P99 (goal < 1 s);
- the machine's 1-minute load average (every 30 s: min, mean, max; the machine may be shared);
- resident memory of the cluster's processes (RSS and PSS, which counts shared pages once) at the
  start and end and every 30 s; host-tier accounting from the node store at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from disagg.config import ingress_max_ongoing, load_config
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.faults import read_ledger
from disagg.launch.local import free_port, local_app, wait_healthy

try:
    import soak_attacks  # run as a script: benchmarks/ is on sys.path
except ImportError:  # imported as benchmarks.soak
    from benchmarks import soak_attacks

MODEL = "disagg-tiny"
KEYS = ["soak-key-a", "soak-key-b"]
MAX_CONTEXT = 1536


@dataclass(slots=True)
class Result:
    """One well-formed request as the client saw it."""

    request_id: str | None  # the server's id (from the first chunk), None if none arrived
    prompt: list[int]  # prompt token ids
    max_tokens: int  # tokens asked for (ignore_eos: all are due)
    tokens: list[int] = field(default_factory=list)  # tokens received, in order
    status: int = 0  # HTTP status (0: transport error)
    error: str | None = None  # error event or transport error
    tries: int = 1  # attempts (shed requests are retried)

    @property
    def served(self) -> bool:
        return self.status == 200 and self.error is None and len(self.tokens) == self.max_tokens


@dataclass(slots=True)
class Tally:
    results: list[Result] = field(default_factory=list)
    bad: Counter = field(default_factory=Counter)  # kind -> tried
    bad_ok: Counter = field(default_factory=Counter)  # kind -> answered with the expected 4xx error
    bad_wrong: list[str] = field(default_factory=list)  # unexpected answers to bad inputs
    shed: int = 0  # 429/503 answers (then retried)


# -- the load ---------------------------------------------------------------------------------
def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 260) for _ in range(n)]


async def _stream(client: httpx.AsyncClient, key: str, body: dict, tally: Tally) -> Result:
    res = Result(None, body["prompt"], body["max_tokens"])
    for attempt in range(1, 6):
        res.tries, res.tokens, res.error = attempt, [], None
        try:
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                res.status = r.status_code
                if r.status_code in (429, 503):  # refused at the edge (limits, load shedding): retry later
                    tally.shed += 1
                    res.error = (await r.aread()).decode(errors="replace")[:300]
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    continue
                if r.status_code != 200:
                    res.error = (await r.aread()).decode(errors="replace")[:300]
                    return res
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        res.error = json.dumps(obj["error"])[:300]
                        continue
                    res.request_id = res.request_id or obj.get("id")
                    for choice in obj.get("choices", ()):
                        res.tokens.extend(choice.get("token_ids") or [])
                if not done and res.error is None:
                    res.error = "stream ended without [DONE]"
                return res
        except httpx.HTTPError as exc:
            res.status, res.error = 0, f"{type(exc).__name__}: {exc}"[:300]
            return res
    return res


# the codes of the 503s (disagg.api.app; deployments.ingress: no decode replica came back in time)
_CODES_503 = ('"overloaded"', '"backend_unavailable"', '"stream_resume_timeout"')
_BAD = {  # kind -> (how to send it, expected status)
    "no_key": 401, "wrong_key": 401, "unknown_model": 404, "malformed_json": 400, "nan_temperature": 400,
    "out_of_vocab": 400, "context_overflow": 400, "negative_max_tokens": 400, "oversize_body": 413,
    "image_content": 400,
}


async def _bad_input(client: httpx.AsyncClient, key: str, rng: random.Random, tally: Tally) -> None:
    kind = rng.choice(sorted(_BAD))
    auth = {"Authorization": f"Bearer {key}"}
    ok_body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    path, kwargs = "/v1/completions", {}
    if kind == "no_key":
        kwargs = {"json": ok_body}
    elif kind == "wrong_key":
        kwargs = {"json": ok_body, "headers": {"Authorization": "Bearer not-a-key"}}
    elif kind == "unknown_model":
        kwargs = {"json": {**ok_body, "model": "gpt-none"}, "headers": auth}
    elif kind == "malformed_json":
        kwargs = {"content": b'{"model": "disagg-tiny", "prompt": ', "headers": {**auth, "content-type": "application/json"}}
    elif kind == "nan_temperature":
        kwargs = {"content": b'{"model": "disagg-tiny", "prompt": "x", "temperature": NaN}',
                  "headers": {**auth, "content-type": "application/json"}}
    elif kind == "out_of_vocab":
        kwargs = {"json": {**ok_body, "prompt": [5, 6, 10**9]}, "headers": auth}
    elif kind == "context_overflow":
        kwargs = {"json": {**ok_body, "max_tokens": 10**8}, "headers": auth}
    elif kind == "negative_max_tokens":
        kwargs = {"json": {**ok_body, "max_tokens": -3}, "headers": auth}
    elif kind == "oversize_body":
        kwargs = {"json": {**ok_body, "prompt": "x" * (5 << 20)}, "headers": auth}
    elif kind == "image_content":
        path = "/v1/chat/completions"
        kwargs = {"json": {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}}]}]}, "headers": auth}
    tally.bad[kind] += 1
    try:
        r = await client.post(path, **kwargs)
        err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
    except (httpx.HTTPError, ValueError) as exc:
        tally.bad_wrong.append(f"{kind}: {type(exc).__name__}")
        return
    if r.status_code == _BAD[kind] and isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}:
        tally.bad_ok[kind] += 1
    else:
        tally.bad_wrong.append(f"{kind}: {r.status_code} {r.text[:120]}")


async def _session_loop(idx: int, client: httpx.AsyncClient, prefix: list[int], stop_at: float,
                        bad_rate: float, tally: Tally) -> None:
    rng = random.Random(1000 + idx)
    key = KEYS[idx % len(KEYS)]
    generation = 0
    while time.monotonic() < stop_at:
        sid = f"soak-{idx}-{generation}"
        context = prefix + _ids(rng, rng.randint(200, 400))
        while time.monotonic() < stop_at and len(context) < MAX_CONTEXT:
            if rng.random() < bad_rate:
                await _bad_input(client, key, rng, tally)
            n = rng.randint(8, 24)
            body = {"model": MODEL, "prompt": context, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "session_id": sid, "return_token_ids": True, "stream": True}
            res = await _stream(client, key, body, tally)
            tally.results.append(res)
            if not res.served:
                break  # a broken conversation starts over
            context = context + res.tokens + _ids(rng, rng.randint(20, 120))
            await asyncio.sleep(rng.uniform(0.0, 0.3))  # the agent's tool call
        generation += 1


# -- measurements -------------------------------------------------------------------------------
def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kib(path: str, field_name: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cluster_memory() -> dict:
    """RSS and PSS (MiB) of this process's descendants: the local Ray cluster and its replicas."""
    rss = pss = 0
    by_role: Counter = Counter()
    for pid in _descendants(os.getpid()):
        r, p = _kib(f"/proc/{pid}/status", "VmRSS"), _kib(f"/proc/{pid}/smaps_rollup", "Pss")
        rss, pss = rss + r, pss + p
        try:
            name = open(f"/proc/{pid}/cmdline").read().split("\0")[0]
        except OSError:
            name = "?"
        role = name.split(":")[-1] if name.startswith("ray::ServeReplica") else name.split("/")[-1][:40]
        by_role[role] += p
    return {"rss_mib": rss / 1024, "pss_mib": pss / 1024,
            "pss_mib_by_process": {k: round(v / 1024, 1) for k, v in by_role.most_common(8)}}


def host_tier_stats() -> dict:
    import ray

    from deployments.node_store import _PREFIX, NAMESPACE

    out = {}
    for node in ray.nodes():
        try:
            actor = ray.get_actor(_PREFIX + node["NodeID"], namespace=NAMESPACE)
            out[node["NodeID"][:12]] = ray.get(actor.stats.remote(), timeout=30)["host"]
        except Exception as exc:  # report, do not fail the run
            out[node["NodeID"][:12]] = {"error": repr(exc)}
    return out


async def _metrics_text(client: httpx.AsyncClient) -> str:
    try:
        return (await client.get("/metrics", timeout=30)).text
    except httpx.HTTPError:
        return ""


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# -- the run --------------------------------------------------------------------------------------
def _config(args, ledger: str):
    cfg = load_config("deployments/configs/local-cpu.yaml")
    cfg.http.port = args.port or free_port()
    cfg.http.api_keys = list(KEYS)
    cfg.http.max_inflight, cfg.http.max_queued = 48, 48  # a burst of 200 is partly shed
    cfg.deployment.ingress.max_ongoing_requests = ingress_max_ongoing(cfg.http)  # config NOTE 1
    cfg.deployment.decode.num_replicas, cfg.deployment.decode.num_cpus = 2, 0.5
    cfg.deployment.prefill.num_replicas, cfg.deployment.prefill.num_cpus = 1, 0.5
    cfg.router.local_prefill_max_tokens = 128
    cfg.transfer.host.capacity_mb = args.host_mb
    cfg.transfer.load_deadline_s = 2.0
    t, k = args.transfer_fault_rate, args.kill_rate
    rules = [{"fault": f, "rate": t, "delay_s": 10.0} for f in ("drop", "delay", "corrupt") if t > 0]
    if k > 0:
        rules += [{"fault": "kill_decode", "rate": k, "after_tokens": 2}, {"fault": "kill_prefill", "rate": k}]
    cfg.faults = cfg.faults.model_validate({"enabled": bool(rules), "seed": args.seed, "rules": rules,
                                            "ledger_path": ledger})
    return cfg


async def _load(url: str, args, tally: Tally, samples: list[dict], attacks: soak_attacks.AttackTally) -> dict:
    limits = httpx.Limits(max_connections=2 * args.sessions + 8, max_keepalive_connections=2 * args.sessions)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), limits=limits) as client:
        t0 = time.monotonic()
        args.t0_epoch = time.time()
        stop_at = t0 + args.minutes * 60
        prefix = _ids(random.Random(7), 192)  # shared by every session (the tool + system prompt)
        tasks = [asyncio.create_task(_session_loop(i, client, prefix, stop_at, args.bad_input_rate, tally))
                 for i in range(args.sessions)]
        receiver, sender = multiprocessing.Pipe(duplex=False)
        prober = multiprocessing.get_context("spawn").Process(
            target=soak_attacks.health_probe, args=(url, time.time() + args.minutes * 60, sender), daemon=True)
        prober.start()
        attack_tasks = asyncio.create_task(soak_attacks.start(url, KEYS[1], stop_at, args, attacks))
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=max(1.0, min(30.0, stop_at - time.monotonic())))
            if pending and time.monotonic() > stop_at:
                continue  # the last turns are finishing: no sample until they are done
            mem = await asyncio.to_thread(cluster_memory)
            served = sum(r.served for r in tally.results)
            samples.append({"t_s": round(time.monotonic() - t0, 1), "served": served, **mem,
                            "load_avg_1m": round(os.getloadavg()[0], 2),
                            "faults": sum(1 for e in read_ledger(args.ledger) if "fault" in e)})
            print(f"[soak {samples[-1]['t_s']:6.0f} s] requests {len(tally.results)} served {served} "
                  f"faults {samples[-1]['faults']} bad inputs {sum(tally.bad.values())} "
                  f"RSS {mem['rss_mib']:.0f} MiB PSS {mem['pss_mib']:.0f} MiB", flush=True)
        for t in tasks:
            t.result()  # a bug in the load generator must not pass silently
        seconds = time.monotonic() - t0
        for t in await attack_tasks:
            await t
        attacks.health = await asyncio.to_thread(receiver.recv)
        prober.join(30)
        final = await soak_attacks.final_abandon_check(url, KEYS[1], args.seed, attacks)
        print(f"[soak] attacks {attacks.summary()} final abandon check {final}", flush=True)
        return {"metrics": await _metrics_text(client), "seconds": seconds, "abandon_check": final}


def _verify(cfg, tally: Tally, faulted: set[str], args) -> dict:
    """Compare outputs with the uninterrupted run: every faulted request, then a sample."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reference = build_reference_engine(cfg)
    served = [r for r in tally.results if r.served]
    chosen = [r for r in served if r.request_id in faulted]
    rest = [r for r in served if r.request_id not in faulted]
    chosen += random.Random(args.seed).sample(rest, min(len(rest), args.verify_sample))
    mismatched, checked = [], 0
    deadline = time.monotonic() + args.verify_minutes * 60
    for i, r in enumerate(chosen):
        if time.monotonic() > deadline:
            break
        want, _ = reference.generate(EngineRequest(f"verify-{i}", r.prompt,
                                                   SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)))
        checked += 1
        if want != r.tokens:
            mismatched.append(r.request_id)
    torch.set_num_threads(threads)
    return {"checked": checked, "checked_faulted": sum(1 for r in chosen[:checked] if r.request_id in faulted),
            "mismatched": mismatched, "candidates": len(chosen)}


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "mean": round(sum(values) / len(values), 1), "max": max(values)} if values else {}


def _plot(samples: list[dict], kills: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in samples]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, k in enumerate(kills):  # a killed replica's memory is gone until its replacement loads
        ax1.axvline(k / 60, color="grey", linestyle=":", linewidth=1, label="replica killed" if i == 0 else None)
    ax1.plot(t, [s["rss_mib"] for s in samples], label="RSS (shared pages counted per process)")
    ax1.plot(t, [s["pss_mib"] for s in samples], label="PSS (shared pages counted once)")
    ax1.set_xlabel("minutes")
    ax1.set_ylabel("MiB, all cluster processes")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax2.plot(t, [s["served"] for s in samples], label="requests served in full")
    ax2.plot(t, [s["faults"] for s in samples], label="faults injected")
    ax2.set_xlabel("minutes")
    ax2.set_ylabel("cumulative count")
    ax2.legend(fontsize=8)
    fig.suptitle("soak: resident memory and progress under injected faults")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--transfer-fault-rate", type=float, default=0.03, help="per state load, for each of drop/delay/corrupt")
    ap.add_argument("--kill-rate", type=float, default=0.01, help="per decode request and per prefill call")
    ap.add_argument("--bad-input-rate", type=float, default=0.05, help="per turn")
    ap.add_argument("--host-mb", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help="the HTTP port (0: a free one)")
    ap.add_argument("--verify-sample", type=int, default=40, help="unfaulted requests compared with the reference")
    ap.add_argument("--verify-minutes", type=float, default=5.0)
    ap.add_argument("--out", default="results/soak", help="folder for soak.json and soak.png")
    ap.add_argument("--attack-delay-s", type=float, default=60.0, help="sessions alone this long first (baseline)")
    ap.add_argument("--slow-bodies", type=int, default=200, help="slow-body connections held open (attack)")
    ap.add_argument("--header-trickles", type=int, default=100, help="header-trickle connections held open (attack)")
    ap.add_argument("--abandon-every-s", type=float, default=10.0, help="a non-streamed request abandoned this often")
    ap.add_argument("--burst-every-s", type=float, default=60.0)
    ap.add_argument("--burst-size", type=int, default=200, help="streamed requests at once per overload burst")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.ledger = os.path.join(tempfile.mkdtemp(prefix="disagg-soak-"), "faults.jsonl")
    cfg = _config(args, args.ledger)
    tally, samples, attacks = Tally(), [], soak_attacks.AttackTally()
    print(f"soak: {args.sessions} sessions for {args.minutes:g} min; faults {[r.fault for r in cfg.faults.rules]}; "
          f"ledger {args.ledger}", flush=True)
    with local_app(cfg) as url:
        wait_healthy(url)
        start_mem = cluster_memory()
        samples.append({"t_s": 0.0, "served": 0, "faults": 0, **start_mem})
        run = asyncio.run(_load(url, args, tally, samples, attacks))
        time.sleep(2.0)  # background turn-end publishes land
        end_mem = cluster_memory()
        host = host_tier_stats()
    ledger = read_ledger(args.ledger)
    faults = [e for e in ledger if "fault" in e]
    by_id = {r.request_id: r for r in tally.results if r.request_id}
    faulted = {e["request_id"].split("~")[0] for e in faults if e.get("request_id")}
    check = _verify(cfg, tally, faulted, args)
    mismatched = set(check["mismatched"])
    survived: Counter = Counter()
    unmatched: Counter = Counter()
    for e in faults:
        r = by_id.get((e.get("request_id") or "").split("~")[0])
        if r is None:
            unmatched[e["fault"]] += 1
        elif r.served and r.request_id not in mismatched:
            survived[e["fault"]] += 1
    results = tally.results
    statuses = Counter(r.status for r in results)
    report = {
        "minutes": round(run["seconds"] / 60, 2), "sessions": args.sessions,
        "fault_rates": {"transfer_each": args.transfer_fault_rate, "kill": args.kill_rate},
        "requests": len(results), "served": sum(r.served for r in results),
        "status_counts": {str(k): v for k, v in sorted(statuses.items())},
        "5xx": sum(v for k, v in statuses.items() if k >= 500) + sum(
            1 for r in results if r.status == 200 and r.error and "server_error" in r.error),
        # an error event inside a 200 stream carries its status's code: 503s are overloaded or
        # backend_unavailable (with Retry-After before the stream started), anything else a 500
        "5xx_other_than_503": sum(v for k, v in statuses.items() if k >= 500 and k != 503) + sum(
            1 for r in results if r.status == 200 and r.error and "server_error" in r.error
            and not any(code in r.error for code in _CODES_503)),
        "503_in_stream": sum(1 for r in results if r.status == 200 and r.error
                             and any(code in r.error for code in _CODES_503)),
        # explicit errors: a stream no decode replica took back within stream_resume_timeout_s
        "stream_resume_timeouts": sum(1 for r in results if r.error and '"stream_resume_timeout"' in r.error),
        "stream_resume_timeouts_at_ingress": _metric(run["metrics"], "disagg_stream_resume_timeouts"),
        "load_avg_1m": _spread([s["load_avg_1m"] for s in samples if "load_avg_1m" in s]),
        "transport_errors": statuses.get(0, 0), "shed_and_retried": tally.shed,
        "tokens_requested": sum(r.max_tokens for r in results),
        "tokens_lost": sum(r.max_tokens - len(r.tokens) for r in results if not r.served or r.error),
        "failed_examples": [f"{r.status} {r.error}" for r in results if not r.served][:10],
        "faults_injected": dict(Counter(e["fault"] for e in faults)),
        "faults_survived": dict(survived), "faults_unmatched_to_a_request": dict(unmatched),
        "recoveries": dict(Counter(e["recovery"] for e in ledger if "recovery" in e)),
        "resumed_streams_at_ingress": _metric(run["metrics"], "disagg_resumed_streams"),
        "attacks": attacks.summary(), "abandoned_final_check": run["abandon_check"],
        "edge_rejections": {m[1]: float(m[2]) for m in re.finditer(
            r'disagg_http_rejections_total\{reason="(\w+)"\} (\S+)', run["metrics"])},
        "verified_against_reference": check,
        "bad_inputs_tried": dict(tally.bad), "bad_inputs_refused_as_expected": dict(tally.bad_ok),
        "bad_input_surprises": tally.bad_wrong[:10],
        "memory_start": start_mem, "memory_end": end_mem, "memory_samples": samples,
        "kill_times_s": [round(e["time"] - args.t0_epoch, 1) for e in faults if e["fault"].startswith("kill")],
        "host_tier_end": host,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    _plot(samples, report["kill_times_s"], out / "soak.png")
    show = {k: v for k, v in report.items() if k not in ("memory_samples", "failed_examples")}
    print(json.dumps(show, indent=1))
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")


if __name__ == "__main__":
    main()
