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
6. A step of single-token sequences only, all in one paged cache (the decode
   steps of a busy decode worker), replays as ONE graph, mixing included
   (``_DecodeGraph``): the ``DecodeBatch`` mixing is already shaped by
   tensors (rows, KDA slots, MLA write rows, padded block tables, key mask),
   so it captures once its shapes are fixed. Rows pad to a bucket of
   ``BUCKETS``, block tables to a power of two; a pad row repeats row 0 (its
   token, slot, write row, table and mask), so it computes row 0's values and
   its writes to row 0's slot and MLA row are row 0's own, whatever order they
   land in. A graph binds one cache's pools (they are allocated once and
   never move), so the cache keeps its graphs (``PagedStateCache.decode_graphs``,
   per runner, by rows and table width): they go when the engine goes, and a
   runner dropped with moved weights takes its graphs with it.
7. Capturing runs the step once (the warm-up before a real capture, the
   stand-in's first run): its MLA writes are the step's own rows, rewritten
   with the same values by the replay, but its KDA recurrence would advance
   the state twice, so the step's slots are saved before and restored after.
8. A graph keeps the peak of its intermediates reserved in the runner's
   pool for the model's life, and a decode step's largest is one MLA layer's
   keys gathered through the padded tables (rows x width x block x latent).
   Steps whose gather would pass ``MAX_DECODE_GATHER_BYTES`` (2 GiB: 32 rows
   of 58K tokens of K3's 576-wide bf16 latents) run piecewise, where that
   memory is freed after the step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from disagg.engine.reference.layers import compute_dtype, state_dtype
from disagg.engine.reference.paged_cache import DecodeBatch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)
MAX_DECODE_GATHER_BYTES = 1 << 31  # NOTE 8: a decode step gathering more keys than this runs piecewise


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
        out, self._pool = _capture_into(fn, self.graphs, self._pool, self._stream)
        return out


def _capture_into(fn: Callable, graphs: list, pool, stream: torch.cuda.Stream | None):
    """Capture ``fn`` as a CUDA graph in ``pool`` (or a stand-in without a stream, NOTE 5);
    append it to ``graphs``; return (its outputs, the pool)."""
    if stream is None:  # NOTE 5
        graph = _EagerGraph(fn)
        graphs.append(graph)
        return graph.out, pool
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (cuBLAS workspaces, cached weights)
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = fn()
    graphs.append(graph)
    return out, pool if pool is not None else graph.pool()


def table_bucket(nb: int) -> int:
    """The padded block-table width of a decode step whose longest table has ``nb`` blocks."""
    return 1 << max(nb - 1, 0).bit_length()


class _DecodeGraph:
    """One graph of a whole decode step over one cache (NOTE 6): embed, then every layer's
    token-wise parts and its ``DecodeBatch`` mixing, into ``h_out``."""

    def __init__(self, model, cache, rows: int, width: int, pool, stream: torch.cuda.Stream | None):
        dev = model.model.embed_tokens.weight.device
        bs = cache.layout.block_size
        self.cache, self.rows, self.width = cache, rows, width
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.batch = DecodeBatch(cache, torch.arange(rows, device=dev),
                                 torch.zeros(rows, dtype=torch.long, device=dev),
                                 torch.zeros(rows, dtype=torch.long, device=dev),
                                 torch.zeros(rows, width, dtype=torch.long, device=dev),
                                 torch.ones(rows, width * bs, dtype=torch.bool, device=dev))
        self._model, self._pool, self._stream = model, pool, stream
        self.graphs: list = []
        self.h_out: torch.Tensor | None = None

    def load(self, ids: torch.Tensor, decode: DecodeBatch) -> None:
        """Bind a step: its n rows, then pad rows repeating row 0 (NOTE 6)."""
        n, b = ids.shape[0], self.batch
        nb, bs = decode.tables.shape[1], self.cache.layout.block_size
        self.ids[:n].copy_(ids)
        b.slots[:n].copy_(decode.slots)
        b.write_at[:n].copy_(decode.write_at)
        b.tables[:n, :nb].copy_(decode.tables)
        b.tables[:n, nb:].zero_()
        b.masked[:n, : nb * bs].copy_(decode.masked)
        b.masked[:n, nb * bs:].fill_(True)
        if n < self.rows:
            for t in (self.ids, b.slots, b.write_at, b.tables, b.masked):
                t[n:].copy_(t[:1].expand_as(t[n:]))

    def run(self) -> torch.Tensor:
        """Replay (capturing on the first call, NOTE 7); the residual stream, all rows."""
        if self.h_out is None:
            model, b = self._model, self.batch
            layers = model.model.layers

            def full(ids=self.ids):
                h = model.model.embed_tokens(ids)
                for layer, kind_idx in zip(layers, model._kind_idx, strict=True):
                    h = layer(h, [], kind_idx, True, b)
                return h

            c = self.cache
            saved = c.conv_all[:, b.slots], c.rec_all[:, b.slots]  # NOTE 7
            try:
                self.h_out, self._pool = _capture_into(full, self.graphs, self._pool, self._stream)
            finally:
                c.conv_all[:, b.slots] = saved[0]
                c.rec_all[:, b.slots] = saved[1]
        self.graphs[0].replay()
        return self.h_out


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
        self.decode_captures = 0  # whole-step decode graphs captured so far (NOTE 6)
        self.decode_failed: str | None = None  # why whole-step decode graphs were turned off (NOTE 3)

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

    @torch.inference_mode()
    def forward_decode(self, ids: torch.Tensor, pick: torch.Tensor, decode: DecodeBatch) -> torch.Tensor | None:
        """A step of single-token sequences of one cache as one graph (NOTE 6): the residual stream
        at rows ``pick``; None when this runner does not take it (the caller tries ``forward``)."""
        rows, width = bucket_for(ids.shape[0]), table_bucket(decode.tables.shape[1])
        if rows is None or self.failed is not None or self.decode_failed is not None:
            return None
        layout = decode.cache.layout  # NOTE 8: one MLA layer's gathered keys, as padded
        gathered = rows * width * layout.block_size * layout.latent_dim * decode.cache.mla_all.element_size()
        if gathered > MAX_DECODE_GATHER_BYTES:
            return None
        owned = decode.cache.decode_graphs.setdefault(self, {})  # NOTE 6: the cache owns them
        with self._lock:  # NOTE 1
            g = owned.get((rows, width))
            if g is None:
                g = owned[(rows, width)] = _DecodeGraph(self.model, decode.cache, rows, width, self._pool,
                                                        self._stream)
                self.decode_captures += 1
            g.load(ids, decode)
            try:
                h = g.run()
            except Exception as e:  # noqa: BLE001 - NOTE 3: degrade, never fail the step
                owned.pop((rows, width), None)
                self.decode_failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture of decode steps failed (%s); they run piecewise from now on",
                            self.decode_failed)
                return None
            self._pool = g._pool  # every graph of the runner shares one pool (NOTE 2)
            return h[pick]
