"""Per-request records and aggregate figures of a simulation run.

    TTFT          = first token - arrival
    ITL           = (finish - first token) / (output - 1)      (output > 1)
    interactivity = 1 / ITL;  P90 interactivity = 1 / P90(ITL)
    hit / theory  = sum(cached tokens) / sum(theoretical reusable tokens),
                    theoretical = longest prefix of full blocks seen before in
                    the run (infinite shared cache), capped at prompt - 1
    max/mean q    = max_w avg_t q_w(t) / mean_w avg_t q_w(t), q_w(t) = prefill tokens
                    queued or in the running prefill step of prefill-capable worker w,
                    avg_t over the run [first arrival, last event]; every worker
                    shares that window, so this is max/mean of the integrals of q_w
                    (a "busy period" window common to all workers gives the same ratio)
    max/mean work = max/mean of prefill tokens computed per prefill-capable worker
    tokens/s/GPU  = (input + output tokens) / makespan / GPUs (workers x gpus_per_worker)

``bench_summary`` gives the measured (non-warm-up) requests the benchmark's
own ``RunSummary`` (``disagg.tools.bench.metrics``): the same definitions of
TTFT, ITL, P90 interactivity, window and tokens/s/GPU as a ``disagg bench``
run against a real server, so the two can be compared line by line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    request_id: str  # unique id
    session_id: str  # session
    turn: int  # turn in session
    prompt_len: int  # prompt tokens
    output_len: int  # output tokens
    arrival: float  # seconds
    theoretical_tokens: int = 0  # infinite-cache reusable tokens
    predicted_tokens: int = 0  # router's predicted hit
    cached_tokens: int = 0  # realized resumed tokens
    cached_tier: str | None = None  # slowest tier of the resume
    prefill_worker: str = ""  # where prefill ran
    decode_worker: str = ""  # where decode ran
    reason: str = ""  # router reason
    first_token: float = -1.0  # seconds
    admitted: float = -1.0  # seconds: its prefill's first step, where the engine looks its device up again
    stored: float = -1.0  # seconds: its prefill's end, when its state is stored (P/D: before its first token)
    # (seconds, full blocks computed) at each chunk of its prefill cached before its end (Simulator NOTE 11)
    chunks: list[tuple[float, int]] | None = None
    finish: float = -1.0  # seconds
    lane: int = -1  # closed-loop lane (-1: open loop)
    salt: int = 0  # cache-busting salt of the replay
    warmup: bool = False  # excluded from the benchmark metrics
    last_turn: bool = False  # its session's last turn (closed loop): what a client marks session_end
    # where its reuse was lost (ClusterConfig.explain_misses, Simulator NOTE 10; -1: not measured)
    reach_tokens: int = -1  # the furthest any worker could have resumed it when it was placed
    stored_tokens: int = -1  # its leading full blocks that some tier of the cluster held then, in tokens
    gap_stored_before: bool = False  # the first block no tier held had been stored before (evicted)
    kept: tuple[str, ...] = ()  # the kind of each checkpoint its prefill kept (CHECKPOINT_KINDS)
    resumed_from: str = ""  # the kind of the checkpoint it resumed from ("": none)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def itl(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.finish - self.first_token) / (self.output_len - 1)


def to_request_results(records: list[RequestRecord]) -> list:
    """Benchmark ``RequestResult``s of finished records (times in simulated ns)."""
    from disagg.tools.bench.client import RequestResult

    out = []
    for r in records:
        if r.finish < 0:
            continue
        res = RequestResult(r.request_id, int(round(r.arrival * 1e9)), int(round(r.first_token * 1e9)),
                            int(round(r.finish * 1e9)), output_tokens=r.output_len, prompt_tokens=r.prompt_len,
                            cached_tokens=r.cached_tokens, status=200)
        res.session_id, res.turn, res.lane, res.salt = r.session_id, r.turn, r.lane, r.salt
        res.input_length, res.expected_output, res.warmup = r.prompt_len, r.output_len, r.warmup
        out.append(res)
    return out


def bench_summary(records: list[RequestRecord], num_gpus: int, theoretical_hit: float | None = None,
                  usd_per_gpu_hour: float | None = None):
    """The benchmark's ``RunSummary`` of the finished, measured records."""
    from disagg.tools.bench.metrics import summarize as bench_summarize

    return bench_summarize(to_request_results(records), num_gpus=num_gpus, theoretical_hit=theoretical_hit,
                           usd_per_gpu_hour=usd_per_gpu_hour)


LOST = ("lost_placement", "lost_checkpoint", "lost_evicted", "lost_in_flight")


def reuse_lost(records: list[RequestRecord]) -> dict[str, float]:
    """Where the reuse an infinite cache would have had went, as shares of its reusable tokens
    (the finished records measured with ``explain_misses``; empty when there are none)::

        placement    another worker could have resumed further when the request was placed
        checkpoint   the cluster held the blocks, but no worker a resume point as far
        evicted      no tier held the next block, and one had held it (capacity, eviction order)
        in flight    no tier held the next block yet (its first prefill had not stored it)

    Per request, with t its infinite-cache tokens and c what it resumed (both capped at t):
    placement = reach - c, checkpoint = stored - reach, the rest t - stored goes to evicted or
    in flight by the first block missing, each floored at what came before; the four and c sum
    to t."""
    rs = [r for r in records if r.finish >= 0 and r.reach_tokens >= 0]
    theo = sum(r.theoretical_tokens for r in rs)
    if not theo:
        return {}
    lost = dict.fromkeys(LOST, 0)
    for r in rs:
        t = r.theoretical_tokens
        x0 = min(r.cached_tokens, t)
        x1 = max(x0, min(r.reach_tokens, t))
        x2 = max(x1, min(r.stored_tokens, t))
        lost["lost_placement"] += x1 - x0
        lost["lost_checkpoint"] += x2 - x1
        lost["lost_evicted" if r.gap_stored_before else "lost_in_flight"] += t - x2
    return {k: v / theo for k, v in lost.items()}


CHECKPOINT_KINDS = ("engine", "branch", "back", "start", "chunk")


def checkpoint_use(records: list[RequestRecord]) -> dict[str, float]:
    """Which checkpoints paid, by the rule that kept each (the finished records measured with
    ``explain_misses``; empty when there are none). Per kind (``CHECKPOINT_KINDS``: the engine's
    own at the prompt end and last full block, and periodic ones; the learned placement's branch,
    back and start points, ``disagg.reuse.placement``; a prefill chunk's, Simulator NOTE 11)::

        ckpt_kept_<kind>      checkpoints the prefills kept
        ckpt_resumes_<kind>   resumes from one of them
        ckpt_tokens_<kind>    their share of every resumed token

    A checkpoint is credited to the rule of the latest prefill that kept it."""
    rs = [r for r in records if r.finish >= 0 and r.reach_tokens >= 0]
    if not rs:
        return {}
    kept = dict.fromkeys(CHECKPOINT_KINDS, 0)
    resumes = dict.fromkeys(CHECKPOINT_KINDS, 0)
    tokens = dict.fromkeys(CHECKPOINT_KINDS, 0)
    for r in rs:
        for kind in r.kept:
            kept[kind] += 1
        if r.resumed_from and r.cached_tokens:
            resumes[r.resumed_from] += 1
            tokens[r.resumed_from] += r.cached_tokens
    total = sum(tokens.values())
    return ({f"ckpt_kept_{k}": v for k, v in kept.items()} | {f"ckpt_resumes_{k}": v for k, v in resumes.items()}
            | {f"ckpt_tokens_{k}": v / total if total else 0.0 for k, v in tokens.items()})


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(
    records: list[RequestRecord],
    queue_avgs: dict[str, float],
    prefill_work: dict[str, int],
    num_gpus: int,
) -> dict[str, float]:
    done = [r for r in records if r.finish >= 0]
    ttft = [r.ttft for r in done]
    itl = [x for r in done if (x := r.itl) is not None]
    theo = sum(r.theoretical_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    prompt = sum(r.prompt_len for r in done)
    qs = list(queue_avgs.values())
    work = list(prefill_work.values())
    t0 = min((r.arrival for r in done), default=0.0)
    t1 = max((r.finish for r in done), default=0.0)
    span = max(t1 - t0, 1e-9)
    p90_itl = _pct(itl, 90)
    return {
        "requests": len(done),
        "hit_rate": cached / prompt if prompt else 0.0,
        "theoretical_hit_rate": theo / prompt if prompt else 0.0,
        "hit_vs_theory": cached / theo if theo else 1.0,
        "max_mean_queue": (max(qs) / (sum(qs) / len(qs))) if qs and sum(qs) > 0 else 1.0,
        "max_mean_prefill_work": (max(work) / (sum(work) / len(work))) if work and sum(work) > 0 else 1.0,
        "ttft_mean": float(np.mean(ttft)) if ttft else float("nan"),
        "ttft_p50": _pct(ttft, 50),
        "ttft_p90": _pct(ttft, 90),
        "ttft_p99": _pct(ttft, 99),
        "itl_p90": p90_itl,
        "interactivity_p90": 1.0 / p90_itl if p90_itl and p90_itl > 0 else float("nan"),
        "e2e_p90": _pct([r.finish - r.arrival for r in done], 90),
        "tokens_per_s_per_gpu": sum(r.prompt_len + r.output_len for r in done) / span / max(num_gpus, 1),
        "makespan_s": span,
    } | reuse_lost(done) | checkpoint_use(done)  # explain_misses: where the reuse went, which checkpoints paid
