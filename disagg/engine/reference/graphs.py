"""Piecewise CUDA graphs of the reference model's token-wise work (model NOTE 6).

A step of N <= ``MAX_GRAPH_TOKENS`` tokens runs on the buffers of the smallest
bucket B >= N (rows N..B-1 are padding):

    ids[B] -> [head: embed, pre_0] -> mix_0 -> [step_0: post_0, pre_1] -> mix_1 -> ...
              -> [step_{L-1}: post_{L-1}] -> h[B, hidden] -> h[pick] (eager: norm, lm_head)

``[...]`` is a captured graph; ``mix_i`` (sequence mixing over each sequence's
cache: varying history lengths, per-sequence kernels) runs eagerly between
them, reading the previous graph's outputs and writing its result into the
next graph's input buffer. The head's and each step's outputs are the next
graph's inputs in place, so nothing is copied between graphs.

NOTES
1. One runner per model, shared by every engine on it: the graphs and their
   buffers depend only on the weights (and the bucket). A lock makes a forward
   through the runner exclusive, so two engines in one process never replay
   into the same buffers at once.
2. Graphs of every bucket share one memory pool. Within a forward, graphs
   replay in the order they were captured, and every output is referenced for
   the runner's life, so no graph writes over an output that is still needed;
   an output of a later bucket may sit in an earlier bucket's scratch memory,
   but it is read (``h[pick]``) before the lock is released.
3. A bucket is captured the first time a step needs it (about 17 graphs for
   the ``small`` preset): warm-up once on a side stream, then capture in
   ``thread_local`` mode, so state-publishing threads using CUDA meanwhile do
   not invalidate the capture. A capture that fails turns the runner off:
   that step and every later one run eagerly (a warning says why).
4. Everything runs under ``torch.inference_mode`` (the buffers are inference
   tensors). Weights moved or cast (``Module.to``, ``cast_model``) make a new
   runner (``K3ForCausalLM.reset_graphs``); weights loaded in place keep it.
   Nothing is checked per step (a scan of the ~1,750 parameters of the
   ``small`` preset costs milliseconds).
5. ``StepGraphs(model, capture=False)`` puts a stand-in (``_EagerGraph``) in
   place of each graph, on any device: "capture" runs the part once and keeps
   its outputs; a replay runs it again and copies the results into those same
   outputs. The parts read the tensors bound at capture, as a real graph's
   kernels do, so the runner's buffers, padding and data flow are tested on
   a CPU (a real graph's semantics, pools and streams need CUDA).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from disagg.engine.reference.layers import compute_dtype, state_dtype

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def bucket_for(n: int) -> int | None:
    """The smallest bucket holding ``n`` tokens, or None above the largest."""
    return next((b for b in BUCKETS if b >= n), None)


class _Bucket:
    """The captured graphs and static buffers of one padded token count."""

    def __init__(self, model, rows: int, pool, stream: torch.cuda.Stream | None):
        layers = model.model.layers
        dev = model.model.embed_tokens.weight.device
        dtype = model.dtype
        self.rows = rows
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.mix = []  # per layer: the mixing's output buffer, the next graph's input
        for layer in layers:
            a = layer.self_attn
            if layer.is_kda:
                self.mix.append(torch.zeros(rows, a.num_heads, a.head_dim, dtype=state_dtype(dtype), device=dev))
            else:
                self.mix.append(torch.zeros(rows, a.num_heads, a.v_dim, dtype=compute_dtype(dtype), device=dev))
        self._pool, self._stream = pool, stream

        # Each part binds its input tensors as arguments, as its graph binds them at capture
        # (a stand-in, NOTE 5, then reads what a real graph would read).
        def head(ids=self.ids):
            h = model.model.embed_tokens(ids)
            return h, layers[0].pre(h)

        self.graphs = []
        # per layer: the residual stream and pre outputs entering mix_i (the residual stream only
        # to keep every graph output referenced, NOTE 2)
        self.h_in, self.pre = [], []
        h, pre = self._capture(head)
        for i, layer in enumerate(layers):
            self.h_in.append(h)
            self.pre.append(pre)

            def step(i=i, layer=layer, h=h, pre=pre, mixed=self.mix[i]):
                h2 = layer.post(h, pre, mixed)
                return h2, (layers[i + 1].pre(h2) if i + 1 < len(layers) else None)

            h, pre = self._capture(step)
        self.h_out = h

    def _capture(self, fn: Callable):
        if self._stream is None:  # NOTE 5
            graph = _EagerGraph(fn)
            self.graphs.append(graph)
            return graph.out
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):  # warm-up (cuBLAS workspaces, cached weights)
            fn()
        torch.cuda.current_stream().wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
            out = fn()
        self._pool = self._pool if self._pool is not None else graph.pool()
        self.graphs.append(graph)
        return out


class _EagerGraph:
    """A graph's stand-in (NOTE 5): runs ``fn`` and copies its results into the first run's."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        _copy_into(self.out, self.fn())


def _copy_into(kept, fresh) -> None:
    """Copy ``fresh`` into ``kept``: tensors, or (nested) tuples of them and None."""
    if isinstance(kept, torch.Tensor):
        kept.copy_(fresh)
    elif kept is not None:
        for k, f in zip(kept, fresh, strict=True):
            _copy_into(k, f)


class StepGraphs:
    """CUDA graph runner of one model: ``forward`` replaces the eager layer loop (see above)."""

    def __init__(self, model, capture: bool = True):
        """``capture=False``: stand-ins in place of CUDA graphs, on any device (NOTE 5)."""
        self.model = model
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None
        dev = model.model.embed_tokens.weight.device
        self._stream = torch.cuda.Stream(dev) if capture else None
        self._lock = threading.Lock()
        self.captures = 0  # buckets captured so far
        self.failed: str | None = None  # why capturing was turned off (NOTE 3)

    def bucket(self, rows: int) -> _Bucket:
        b = self._buckets.get(rows)
        if b is None:
            b = self._buckets[rows] = _Bucket(self.model, rows, self._pool, self._stream)
            self._pool = b._pool
            self.captures += 1
        return b

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pick: torch.Tensor, spans, absorbed, decode) -> torch.Tensor | None:
        """The residual stream after the last layer, at rows ``pick``; None when this runner does
        not take the step (too many tokens, or capturing failed): the caller runs it eagerly."""
        n = ids.shape[0]
        rows = bucket_for(n)
        if rows is None or self.failed is not None:
            return None
        layers = self.model.model.layers
        with self._lock:  # NOTE 1
            try:
                b = self.bucket(rows)
            except Exception as e:  # noqa: BLE001 - NOTE 3: degrade to eager steps, never fail the step
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed (%s); steps run eagerly from now on", self.failed)
                return None
            b.ids[:n].copy_(ids)
            b.graphs[0].replay()
            for i, (layer, kind_idx) in enumerate(zip(layers, self.model._kind_idx, strict=True)):
                layer.mix(b.pre[i], spans, kind_idx, absorbed, decode, out=b.mix[i])
                b.graphs[i + 1].replay()
            return b.h_out[pick]
