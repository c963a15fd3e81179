"""Decode scorer: prefer workers where the request's decode, and the decodes it joins, run fastest.

For candidate w (B_w running decodes plus the requests on their way to its
batch, which join it before r does: those queued for prefill on w and, P/D,
those prefilling in the pool for w or handing off to it; D_w the context
tokens of the running and inbound decodes; effective loads; n_w = prompt -
resumable(w) tokens r would prefill there; o = r's expected output: the
router's (``ctx.expected_output``, step 0: the client's figure, else what the
session's finished turns generated), else its hint, else
``default_output_tokens``)::

    step_w  = base + per_seq * (B_w + 1) + per_ctx * (D_w + prompt)     r's decode step on w
              (with a measured ``batch_curve`` g: g(B_w + 1) + per_ctx * (...),
              and per_seq below is g(B_w + 1) - g(B_w))
    own_w   = o * step_w                                                r's decode time
    joined_w = B_w * o * (per_seq + per_ctx * prompt)                   what r's decode adds to the
                                                                        B_w decodes it joins, while
                                                                        both run (``count_joined``)
    harm_w  = B_w * n_w / prefill_tokens_per_s                          decode time r's prefill steals
                                                                        from the batch on w (phase
                                                                        "both": it prefills there;
                                                                        "decode": where the P/D
                                                                        decider would take r local on
                                                                        w, else 0)
    join_w  = q_w / prefill_tokens_per_s                                phase "decode": r's first decode
              + ((prompt - held_w) * bytes_per_token                    step waits for the prefill queued
                 + checkpoint_bytes) / bw_w                             on w, for r's state and, when w
              + latency_w                                               runs a batch, for the step in
              + [B_w > 0] * join_step_fraction * step_w                 progress; bw_w: the host link on a
                                                                        node of the prefill pool
                                                                        (``ctx.prefill_nodes``), else the
                                                                        remote link; held_w: what w
                                                                        resumes from its device (the
                                                                        hand-off skips those rows)
    cost_w  = own_w + [count_joined] joined_w + harm_w + join_w
    scale   = o * min_v step_v + max(prompt - common, 0) / prefill_tokens_per_s   r's own service time
              (phase "decode": o * min_v step_v, the time r's ITL is made of)
    score_w = max(1 - (cost_w - min_v cost_v) / scale, 0)               in [0, 1]; 1 for the cheapest

Counting the queued requests in B_w matters under load: a worker whose
prefill queue is long has few running decodes *now* because its requests
have not reached decode yet; counted by running decodes alone it looked the
least loaded, and the scorer sent it the next long prompt too (its wait
scorer's share could not outweigh it), which is what made the TTFT tail
(``count_queued``; docs/router.md, "Round 9"). Across P/D pools the
requests prefilling in the pool for w, or handing off to it, join its batch
too. Their context tokens count in D_w, but by default not in B_w
(``count_inbound``): measured on the router suite's P/D cells over two
seeds, counting them placed no better (17 of 24 cells reached every figure
without, 15 with). Where outputs are a few tokens, the co-runner a request
avoids costs less than the longer hand-off to another worker
(docs/router.md, "Round 20").

In P/D (phase "decode") r prefills on its decode worker only where the
decider takes it local (``ctx.local_prefill``): by the short-suffix rule,
which reads the decode worker alone (``PDDecider.short_suffix``), and, given
the prefill pool's view of r (its loads and what each of its workers could
not resume), by every local rule (``PDDecider.local_mask``; the router's
``harm_pool_view``, on by default). Charged on every candidate, as rounds
7-44 did (``harm_everywhere``), ``harm_w`` priced r's uncached prompt, at
0.44 s a running decode for an 11K question, at a worker whose node held no
copy of its document, for a prefill the pool would run: on the held-out
``rag/pd`` (4 prefill and 12 decode workers on two nodes) the decode workers
on the pool's node took 115-123 of the 1,200 questions each, the other eight
84-94, and the P90 interactivity was theirs (docs/router.md, "Round 45").
Charged by the short-suffix rule alone (round 45), it missed the turns that
rule "local_state" keeps on the worker that resumes their session: a sixth
to two thirds of the router suite's P/D requests (docs/router.md, "Round
46"). A decode pool's router in serving reads the view from its process's
router of the prefill pool (``deployments.request_router`` NOTE 2).

A batch slows each of its members: r's own steps price the decodes it
joins (``own_w``), and ``joined_w`` prices r for them, as ``harm_w`` prices
its prefill. It counts r's o steps, the most the two decodes can overlap.
Aggregated placement counts it (profile "both"): on traces of Mooncake's
format with a few sessions a worker, a turn with a short suffix cost little
of its own at a worker where another session decoded, and joined it; the
other session's interactivity paid (docs/router.md, "Round 25"). P/D decode
placement does not (off by default): its load term, at weight 8, already
weighs the running decodes, and counting them twice placed no better (suite
P/D cells 15 -> 13 of 36 over three seeds, Mooncake-family P/D 7 -> 9 of 24).

Decode-side load enters placement the way queued prefill does through the
wait scorer: as seconds the user feels (here, inter-token latency: a long
batch, long contexts, and prefill chunks interleaved with the decodes),
measured against the request's own service time. Next to the prefix scorer
(which credits a worker's cached state net of its transfer time), a session
leaves the worker holding its state when the decode time it would save there
outweighs the cache credit it gives up; its node mates read the state from
the shared host tier, so a move within the node costs little.

Config example (YAML)::

    decode: {decode_base_s: 0.008, decode_per_seq_s: 1.0e-4, decode_per_ctx_token_s: 2.0e-9,
             prefill_tokens_per_s: 25000, default_output_tokens: 256, join_step_fraction: 0.5,
             count_joined: true, harm_everywhere: false}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from disagg.router.context import LOAD_ROW, RoutingContext
from disagg.router.scorers.base import ArrayScorer
from disagg.router.types import TIER_INDEX, WorkerState

_B = LOAD_ROW["decode_requests"]
_D = LOAD_ROW["decode_tokens"]
_Q = LOAD_ROW["prefill_tokens"]
_N = LOAD_ROW["prefill_requests"]
_IN = LOAD_ROW["inbound_decodes"]
_DEVICE = TIER_INDEX["device"]


@dataclass(slots=True)
class DecodeScorerConfig:
    decode_base_s: float = 0.008  # fixed cost of a decode step
    decode_per_seq_s: float = 1e-4  # per sequence in the batch
    decode_per_ctx_token_s: float = 2e-9  # per context token in the batch
    prefill_tokens_per_s: float = 25000.0  # prefill rate of one worker
    default_output_tokens: float = 256.0  # o when the request gives no hint
    bytes_per_token: float = 4608.0  # state bytes per prompt token (MLA, all layers)
    checkpoint_bytes: float = 16e6  # one KDA checkpoint
    host_gbps: float = 50.0  # state hand-off within a node
    remote_gbps: float = 20.0  # ... across nodes
    host_latency_s: float = 50e-6
    remote_latency_s: float = 1e-3
    join_step_fraction: float = 0.5  # phase decode: expected wait for w's step in progress, in steps
    count_queued: bool = True  # B_w counts the requests queued for prefill on w (they join its batch)
    count_inbound: bool = False  # ... and those prefilling in the pool for w or handing off to it (P/D)
    count_joined: bool = False  # cost_w counts the decode time r's decode adds to the B_w it joins
    harm_everywhere: bool = False  # phase decode: harm_w on every candidate, not only where r is prefilled local
    # [[batch, seconds at zero context], ...]: a measured step curve, used in place of base + per_seq * batch
    batch_curve: list[list[float]] | None = None
    _curve: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if min(self.decode_base_s, self.decode_per_seq_s, self.decode_per_ctx_token_s) < 0:
            raise ValueError("decode costs must be >= 0")
        if self.prefill_tokens_per_s <= 0 or self.default_output_tokens <= 0:
            raise ValueError("prefill_tokens_per_s and default_output_tokens must be positive")
        if not 0.0 <= self.join_step_fraction <= 1.0:
            raise ValueError("join_step_fraction must be in [0, 1]")
        if min(self.host_gbps, self.remote_gbps) <= 0:
            raise ValueError("host_gbps and remote_gbps must be positive")
        if min(self.bytes_per_token, self.checkpoint_bytes, self.host_latency_s, self.remote_latency_s) < 0:
            raise ValueError("state sizes and latencies must be >= 0")
        if self.batch_curve is not None:
            self._curve = _extended(self.batch_curve)


def _extended(curve: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """The step curve's points, sorted, with one more point at each end on its end segments, so
    ``np.interp`` (which holds the end values) extrapolates linearly as the simulator's engine does
    (``disagg.costs.model``); one point: a flat step."""
    pts = sorted((float(b), float(g)) for b, g in curve)
    if not pts or any(b < 1 or g < 0 for b, g in pts) or len({b for b, _ in pts}) != len(pts):
        raise ValueError("batch_curve needs distinct batches >= 1 and step times >= 0")
    if len(pts) == 1:
        return np.array([pts[0][0]]), np.array([pts[0][1]])
    (b0, g0), (b1, g1) = pts[0], pts[1]
    (c0, h0), (c1, h1) = pts[-2], pts[-1]
    lo, hi = 0.0, c1 + 1e6
    xs = [lo] + [b for b, _ in pts] + [hi]
    ys = [g0 - (g1 - g0) * (b0 - lo) / (b1 - b0)] + [g for _, g in pts] + [h1 + (h1 - h0) * (hi - c1) / (c1 - c0)]
    return np.array(xs), np.maximum(np.array(ys), 0.0)


class DecodeScorer(ArrayScorer):
    name = "decode"

    def __init__(self, config: DecodeScorerConfig | None = None, **params: object):
        self.config = config or DecodeScorerConfig(**params)  # type: ignore[arg-type]

    def costs(self, ctx: RoutingContext, workers: list[WorkerState]) -> tuple[np.ndarray, float]:
        """(cost_w in seconds per candidate, the request's own service time ``scale``)."""
        cfg = self.config
        req = ctx.request
        v = ctx.view(workers)
        b = v.loads[_B] + v.loads[_N] if cfg.count_queued else v.loads[_B]
        if cfg.count_inbound:
            b = b + v.loads[_IN]
        out = float(ctx.expected_output or req.output_len_hint or cfg.default_output_tokens)
        ctx_s = cfg.decode_per_ctx_token_s * (v.loads[_D] + req.prompt_len)
        if cfg._curve is None:
            step = cfg.decode_base_s + cfg.decode_per_seq_s * (b + 1.0) + ctx_s
            per_seq = cfg.decode_per_seq_s
        else:  # a measured curve: r's step at B_w + 1 sequences; what r adds, g(B_w + 1) - g(B_w)
            xs, ys = cfg._curve
            with_r = np.interp(b + 1.0, xs, ys)
            step = with_r + ctx_s
            per_seq = with_r - np.interp(b, xs, ys)
        cost = out * step
        if cfg.count_joined:  # each of the B_w decodes r joins steps slower while r decodes beside it
            cost = cost + b * out * (per_seq + cfg.decode_per_ctx_token_s * req.prompt_len)
        if ctx.phase != "prefill":  # it prefills there ("both"), or may (a P/D decider's local rule)
            uncached = np.maximum(req.prompt_len - v.resumable, 0.0)
            if ctx.phase == "decode" and ctx.local_prefill is not None and not cfg.harm_everywhere:
                uncached = np.where(ctx.local_prefill(uncached, v.loads[_B], v.loads[_Q]), uncached, 0.0)
            cost = cost + b * uncached / cfg.prefill_tokens_per_s
        if ctx.phase == "decode":  # r's decode joins after w's local prefills and r's state
            held = np.where(v.tier == _DEVICE, v.resumable, 0.0)  # its device's rows are not moved again
            nbytes = np.maximum(req.prompt_len - held, 0.0) * cfg.bytes_per_token + cfg.checkpoint_bytes
            remote = nbytes / (cfg.remote_gbps * 1e9) + cfg.remote_latency_s
            join = v.loads[_Q] / cfg.prefill_tokens_per_s + remote + (b > 0) * (cfg.join_step_fraction * step)
            if ctx.prefill_nodes:
                pn = ctx.prefill_nodes
                near = np.fromiter((w.node_id in pn for w in workers), bool, len(workers))
                host = nbytes / (cfg.host_gbps * 1e9) + cfg.host_latency_s
                join = join - near * (remote - host)
            return cost + join, out * float(np.minimum.reduce(step))
        own = max(req.prompt_len - ctx.common_tokens(), 0) / cfg.prefill_tokens_per_s
        scale = out * float(np.minimum.reduce(step)) + own
        return cost, scale

    def score_array(self, ctx: RoutingContext, workers: list[WorkerState]) -> np.ndarray:
        cost, scale = self.costs(ctx, workers)
        if scale <= 0:
            return np.ones(len(cost))
        return np.maximum(1.0 - (cost - float(np.minimum.reduce(cost))) / scale, 0.0)
