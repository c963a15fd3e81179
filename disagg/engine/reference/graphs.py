"""Piecewise CUDA graphs of the reference model's steps (model NOTE 6).

A step of N <= ``MAX_GRAPH_TOKENS`` tokens runs on the buffers of the smallest
bucket B >= N (rows N..B-1 are padding). The forward is a chain of parts,

    head (embed, pre_0) | mix_0 | post_0 + pre_1 | mix_1 | ... | post_{L-1}

and every maximal run of capturable parts is one graph; the rest run eagerly
between graphs, reading the previous graph's outputs and writing into the next
graph's input buffers (outputs are the next graph's inputs in place: nothing is
copied between graphs). Token-wise parts are always captured. The mixing is
captured where the step's shape allows it (``Kind``):

    tokens   any step: every mixing part eager (a mix of sequences and lengths)
    prefill  one sequence resuming at a multiple of the KDA chunk (a resumed or
             chunked prefill, a short prompt): KDA mixing captured, MLA eager
    decode   single-token sequences only: KDA mixing captured, MLA eager

so a prefill or decode step is L_mla + 1 graphs with only the MLA attention
(over each sequence's cached rows, whose length varies) launched from Python.

NOTES
1. One runner per model, shared by every engine on it: graphs and buffers
   depend only on the weights and the bucket. A lock makes a forward through
   the runner exclusive, so two engines in one process never replay into the
   same buffers at once.
2. Graphs of every bucket share one memory pool. Within a forward, graphs
   replay in the order they were captured, and every output is referenced for
   the runner's life, so no graph writes over an output still needed; an
   output of a later bucket may sit in an earlier bucket's scratch memory, but
   it is read (``h[pick]``) before the lock is released.
3. A bucket is captured the first time a step needs it: a warm-up run on a
   side stream, then the capture in ``thread_local`` mode, so state-publishing
   threads using CUDA meanwhile do not invalidate it. A capture that fails
   turns the runner off (every later step runs eagerly), with a warning.
4. Everything runs under ``torch.inference_mode`` (the buffers are inference
   tensors); weights replaced (not updated in place) make a new runner
   (``weights_key``).
5. Captured KDA mixing works on the bucket's own state buffers, so graphs do
   not depend on an engine's cache: a forward copies the sequences' KDA states
   in (one gather per kind, pad rows take the first sequence's), replays, and
   copies the real rows back (one scatter per kind). A prefill's pad tokens
   enter the recurrence with g = 0, beta = 0, k = v = 0, which leaves the state
   unchanged (``KimiDeltaAttention.mix_padded``).
6. ``capture=False`` runs the same parts eagerly on the same buffers (the CPU
   tests check the buffer logic that way).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

from disagg.engine.reference.kda import CHUNK
from disagg.engine.reference.layers import compute_dtype, state_dtype
from disagg.engine.reference.paged_cache import PagedSeqCache

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)
KINDS = ("tokens", "prefill", "decode")


def bucket_for(n: int) -> int | None:
    """The smallest bucket holding ``n`` tokens, or None above the largest."""
    return next((b for b in BUCKETS if b >= n), None)


def mixing_captured() -> bool:
    """Whether prefill and decode steps also capture their KDA mixing (NOTE 7)."""
    return os.environ.get("DISAGG_CUDA_GRAPH_MIXING", "0") == "1"


def kind_of(spans, decode) -> str:
    """Which captured shape a step fits (see the module docstring)."""
    if not mixing_captured():
        return "tokens"
    if decode is not None and not spans:
        return "decode"
    if decode is None and len(spans) == 1:
        sp = spans[0]
        if sp.start_pos % CHUNK == 0 and isinstance(sp.cache, PagedSeqCache):
            return "prefill"
    return "tokens"


class _Bucket:
    """The captured graphs and static buffers of one (kind, padded token count)."""

    def __init__(self, model, kind: str, rows: int, pool, stream, capture: bool):
        layers = model.model.layers
        dev = model.model.embed_tokens.weight.device
        dtype = model.dtype
        self.kind, self.rows = kind, rows
        self._pool, self._stream, self._capture_on = pool, stream, capture
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.mix = []  # per layer: the mixing's output buffer
        for layer in layers:
            a = layer.self_attn
            if layer.is_kda:
                self.mix.append(torch.zeros(rows, a.num_heads, a.head_dim, dtype=state_dtype(dtype), device=dev))
            else:
                self.mix.append(torch.zeros(rows, a.num_heads, a.v_dim, dtype=compute_dtype(dtype), device=dev))
        kda_captured = kind != "tokens"
        if kda_captured:  # NOTE 5
            first = next(layer.self_attn for layer in layers if layer.is_kda)
            n_kda = sum(layer.is_kda for layer in layers)
            seqs = rows if kind == "decode" else 1
            width, c = first.conv_width, 3 * first.num_heads * first.head_dim
            self.conv = torch.zeros(n_kda, seqs, width - 1, c, dtype=dtype, device=dev)
            self.rec = torch.zeros(n_kda, seqs, first.num_heads, first.head_dim, first.head_dim,
                                   dtype=state_dtype(dtype), device=dev)
            self.slots = torch.zeros(seqs, dtype=torch.long, device=dev)
            self.n = torch.ones(1, dtype=torch.long, device=dev)
        env = self.env = {}

        def head():
            if kind == "prefill":
                env["valid"] = torch.arange(rows, device=dev) < self.n
            env["h"] = model.model.embed_tokens(self.ids)
            env["pre"] = env["pre_live"][0] = layers[0].pre(env["h"])

        def kda_mix(i: int, kda_idx: int):
            a = layers[i].self_attn
            if kind == "prefill":
                a.mix_padded(env["pre"], self.conv[kda_idx, 0], self.rec[kda_idx, 0], self.n, env["valid"],
                             self.mix[i])
            else:
                qkv, g, beta, _ = env["pre"]
                o, conv, rec = a.decode_step(qkv, a.conv_weight(), g, beta, self.conv[kda_idx], self.rec[kda_idx])
                self.conv[kda_idx].copy_(conv)
                self.rec[kda_idx].copy_(rec)
                self.mix[i].copy_(o)

        env["pre_live"] = {}

        def step(i: int):
            env["h"] = layers[i].post(env["h"], env["pre"], self.mix[i])
            env["pre"] = layers[i + 1].pre(env["h"]) if i + 1 < len(layers) else None
            env["pre_live"][i + 1] = env["pre"]

        parts: list[tuple[bool, Callable]] = [(True, head)]
        for i, (layer, kind_idx) in enumerate(zip(layers, model._kind_idx, strict=True)):
            if layer.is_kda and kda_captured:
                parts.append((True, lambda i=i, k=kind_idx: kda_mix(i, k)))
            else:
                parts.append((False, i))  # eager: mix layer i on the real spans
            parts.append((True, lambda i=i: step(i)))
        # self.program: graphs (or eager functions, capture=False) and eager mixes, in order
        self.program: list[tuple[str, object]] = []
        self.pre_of: dict[int, tuple] = {}  # eager layer -> the pre outputs it reads
        group: list[Callable] = []
        for captured, what in parts + [(False, None)]:
            if captured:
                group.append(what)
                continue
            if group:
                self.program.append(("run", self._make(group)))
                group = []
            if what is not None:
                self.pre_of[what] = env["pre"]
                self.program.append(("mix", what))
        self.h_out = env["h"]

    def pre_for(self, i: int):
        """The pre outputs layer ``i``'s eager mixing reads: the graph's static outputs, or (no
        capture) the ones the last run made."""
        return self.pre_of[i] if self._capture_on else self.env["pre_live"][i]

    def output(self) -> torch.Tensor:
        return self.h_out if self._capture_on else self.env["h"]

    def _make(self, fns: list[Callable]):
        def run():
            for fn in fns:
                fn()

        if not self._capture_on:
            run()  # builds the outputs the next parts read
            return run
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):  # warm-up (cuBLAS workspaces, Triton autotuning, cached weights)
            run()
        torch.cuda.current_stream().wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
            run()
        self._pool = self._pool if self._pool is not None else graph.pool()
        return graph.replay


class StepGraphs:
    """CUDA graph runner of one model: ``forward`` replaces the eager layer loop (see above)."""

    def __init__(self, model, capture: bool = True):
        self.model = model
        self.capture = capture
        self.key = self.weights_key(model)
        self._buckets: dict[tuple[str, int], _Bucket] = {}
        self._pool = None
        dev = model.model.embed_tokens.weight.device
        self._stream = torch.cuda.Stream(dev) if capture else None
        self._lock = threading.Lock()
        self.captures = 0  # buckets built so far
        self.failed: str | None = None  # why capturing was turned off (NOTE 3)

    @staticmethod
    def weights_key(model) -> tuple:
        """Identity of the weights (NOTE 4): any parameter replaced by another tensor changes it."""
        return tuple(p.data_ptr() for p in model.parameters())

    def bucket(self, kind: str, rows: int) -> _Bucket:
        b = self._buckets.get((kind, rows))
        if b is None:
            b = self._buckets[(kind, rows)] = _Bucket(self.model, kind, rows, self._pool, self._stream, self.capture)
            self._pool = b._pool
            self.captures += 1
        return b

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pick: torch.Tensor, spans, absorbed, decode) -> torch.Tensor | None:
        """The residual stream after the last layer at rows ``pick``; None when this runner
        cannot take the step (the caller runs it eagerly)."""
        n = ids.shape[0]
        rows = bucket_for(n)
        if rows is None or self.failed is not None:
            return None
        kind = kind_of(spans, decode)
        with self._lock:  # NOTE 1
            try:
                b = self.bucket(kind, rows)
            except Exception as e:  # noqa: BLE001 - NOTE 3: degrade to eager steps, never fail the step
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed (%s); steps run eagerly from now on", self.failed)
                self._buckets.pop((kind, rows), None)
                return None
            b.ids[:n].copy_(ids)
            cache, slots = self._states_in(b, n, spans, decode)
            layers = self.model.model.layers
            for op, what in b.program:
                if op == "run":
                    what()
                else:
                    layers[what].mix(b.pre_for(what), spans, self.model._kind_idx[what], absorbed, decode,
                                     out=b.mix[what])
            if cache is not None:  # NOTE 5: the real rows' states back to the engine's cache
                m = slots.shape[0]
                cache.conv_all.index_copy_(1, slots, b.conv[:, :m].to(cache.conv_all.dtype))
                cache.rec_all.index_copy_(1, slots, b.rec[:, :m].to(cache.rec_all.dtype))
            return b.output()[pick]

    @staticmethod
    def _states_in(b: _Bucket, n: int, spans, decode):
        """Copy the step's KDA states into the bucket's buffers (NOTE 5); (cache, slots) to copy back."""
        if b.kind == "tokens":
            return None, None
        if b.kind == "decode":
            cache, slots = decode.cache, decode.slots
            b.slots[: slots.shape[0]].copy_(slots)
            b.slots[slots.shape[0] :] = slots[0]  # pad rows read a real state, and are never written back
        else:
            view = spans[0].cache
            cache = view.cache
            b.slots.fill_(view.slot)
            b.n.fill_(n)
            slots = b.slots
        torch.index_select(cache.conv_all, 1, b.slots, out=b.conv)
        torch.index_select(cache.rec_all, 1, b.slots, out=b.rec)
        return cache, slots
