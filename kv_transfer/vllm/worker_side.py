"""Worker side of the K3 state connector: vLLM's cache tensors <-> stored objects.

One instance per worker process (one TP rank). It registers the views vLLM
allocated, then per step: loads (scatter), layer-wise MLA gathers for saves
(``save_layer``, called after each MLA layer ran), the KDA gathers and the
store puts (``finish_saves``), and a report.

    vLLM view (per layer)                     object rows
    MLA   [blocks, 1, rows, C]  -> [blocks, rows, C]       MLABlock.rows [L, rows, C]
    KDA   raw page [blocks, 1, 1, bytes]  (padded page stride; or a (conv, ssm) tuple)
            conv  [blocks, rows_c, C_c]  ("SD"; "DS" is transposed)  KDACheckpoint.conv [L, rows_c, C_c]
            ssm   [blocks, H_local, K, V]                            KDACheckpoint.recurrent

Copies are batched per cache group (``kv_transfer.device``: one index_select /
index_copy_ per layer into one staging tensor, through same-width integer views,
so every dtype round-trips bit for bit).

NOTES
1. TP: the MLA latent is identical on every TP rank; only ranks with
   ``tp_rank < dcp_size`` (one per DCP shard) gather and put full MLA blocks.
   Every rank puts its own KDA head shard (and the small tail, deduplicated by key).
2. A load that cannot deliver every piece touches no block and is reported
   failed: vLLM then recomputes (failed_recving; block ids too when vLLM has a
   single KV cache group, the only case vLLM maps block ids back to requests).
3. A save job is reported complete (finished_sending for finish saves) only
   after its bytes are committed to a tier or the put failed.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kv_transfer.device import (
    CopyHandle,
    _raw,
    alloc_staging,
    gather_blocks,
    gather_slots,
    scatter_blocks,
    scatter_slots,
)
from kv_transfer.keys import BlockHasher, KeyExtras
from kv_transfer.objects import KDACheckpoint, MLABlock, ResumeState, dcp_positions
from kv_transfer.vllm.geometry import CacheGeometry
from kv_transfer.vllm.jobs import LoadJob, SaveJob, WorkerReport
from kv_transfer.vllm.stores import StoreSet

log = logging.getLogger(__name__)


def mla_view(t: torch.Tensor, rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A layer's MLA cache as [blocks, rows, C] (vLLM 0.33 hands [blocks, 1, rows, C])."""
    if t.dim() == 4:
        if t.shape[1] != 1:
            raise ValueError(f"MLA cache with {t.shape[1]} heads; expected one latent head")
        t = t[:, 0]
    if t.dim() != 3 or tuple(t.shape[1:]) != (rows, dim):
        raise ValueError(f"MLA cache of shape {tuple(t.shape)}; expected [blocks, {rows}, {dim}]")
    if t.dtype != dtype:
        if t.element_size() != torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"MLA cache dtype {t.dtype} does not match the spec's {dtype}")
        t = t.view(dtype)
    return t


def kda_views(t, conv_shape: tuple[int, ...], state_shape: tuple[int, ...],
              dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    """A KDA layer's (conv, recurrent) views: from a (conv, ssm) pair, or from vLLM's raw page view."""
    if isinstance(t, (tuple, list)):
        conv, ssm = t[0], t[1]
    else:  # raw int8 pages [blocks, 1, 1, bytes] with a padded page stride (MambaBase.bind_kv_cache)
        pages = t.squeeze(1).squeeze(1) if t.dim() == 4 else t
        if pages.dim() != 2 or pages.element_size() != 1:
            raise ValueError(f"KDA cache view of shape {tuple(t.shape)} / {t.dtype}; expected raw byte pages")
        conv_bytes = math.prod(conv_shape) * torch.empty((), dtype=dtypes[0]).element_size()
        ssm_bytes = math.prod(state_shape) * torch.empty((), dtype=dtypes[1]).element_size()
        if pages.shape[1] < conv_bytes + ssm_bytes:
            raise ValueError(f"KDA page of {pages.shape[1]} B cannot hold {conv_bytes + ssm_bytes} B of state")
        conv = pages[:, :conv_bytes].view(dtypes[0]).view(-1, *conv_shape)
        ssm = pages[:, conv_bytes: conv_bytes + ssm_bytes].view(dtypes[1]).view(-1, *state_shape)
    if tuple(conv.shape[1:]) != tuple(conv_shape) or tuple(ssm.shape[1:]) != tuple(state_shape):
        raise ValueError(f"KDA views {tuple(conv.shape)} / {tuple(ssm.shape)} do not match the spec "
                         f"{conv_shape} / {state_shape}")
    return conv, ssm


@dataclass(slots=True)
class _SaveWork:
    job: SaveJob
    write_mla: bool  # this rank gathers full MLA blocks (NOTE 1)
    pages: dict[int, list[int]]  # MLA group id -> pages to gather (full blocks [+ tail page])
    mla_rows: torch.Tensor | None = None  # staging [L, n_pages * rows, C]
    gathered: set[int] = field(default_factory=set)  # MLA layer slots gathered so far
    handles: list[CopyHandle] = field(default_factory=list)


class WorkerSide:
    """Moves one rank's bytes for the connector's jobs."""

    def __init__(self, geometry: CacheGeometry, stores: StoreSet, tp_rank: int = 0, dcp_rank: int = 0,
                 async_saves: bool = True, copy_stream_factory: Callable[[], object] | None = None):
        if not 0 <= tp_rank < geometry.tp_size or not 0 <= dcp_rank < geometry.dcp_size:
            raise ValueError(f"rank tp{tp_rank}/dcp{dcp_rank} outside tp_size {geometry.tp_size} / "
                             f"dcp_size {geometry.dcp_size}")
        self.geo, self.stores = geometry, stores
        self.tp_rank, self.dcp_rank = tp_rank, dcp_rank
        self.writes_mla = tp_rank < geometry.dcp_size  # NOTE 1
        self._hashers: dict[str, BlockHasher] = {}
        self._mla: dict[int, list[torch.Tensor]] = {}  # MLA group -> layer views (group order)
        self._mla_slots: dict[int, list[int]] = {}  # MLA group -> global MLA layer slots
        self._kda: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # KDA group -> (conv, ssm) views
        self._kda_slots: dict[int, list[int]] = {}  # KDA group -> global KDA layer slots
        self._device = torch.device("cpu")
        self._stream = None
        self._stream_factory = copy_stream_factory
        self._work: list[_SaveWork] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="k3-save") if async_saves else None
        self._futures: list[tuple[SaveJob, Future]] = []
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._error_blocks: set[int] = set()
        self._report = WorkerReport()
        self.counters = dict.fromkeys(("loads", "load_failures", "saves", "save_failures", "bytes_loaded",
                                       "bytes_saved", "objects_saved", "objects_skipped"), 0)

    # ---- registration -------------------------------------------------------
    def register(self, kv_caches: dict) -> None:
        """Take vLLM's per-layer cache views (``register_kv_caches``)."""
        geo = self.geo
        lay = geo.layout
        mla_dtype = getattr(torch, lay.cache_dtype)
        mla_slot = geo.mla_layer_index
        kda_order = {n: i for i, n in enumerate(geo.kda_layer_names())}
        for g in geo.groups:
            missing = [n for n in g.layer_names if n not in kv_caches]
            if missing:
                raise ValueError(f"register_kv_caches lacks layers of group {g.group_id}: {missing[:3]}")
            if g.kind == "mla":
                self._mla[g.group_id] = [mla_view(kv_caches[n], geo.mla_rows, lay.latent_dim, mla_dtype)
                                         for n in g.layer_names]
                self._mla_slots[g.group_id] = [mla_slot[n] for n in g.layer_names]
            else:
                views = [kda_views(kv_caches[n], geo.conv_shape, geo.state_shape, geo.state_dtypes)
                         for n in g.layer_names]
                self._kda[g.group_id] = ([c for c, _ in views], [s for _, s in views])
                self._kda_slots[g.group_id] = [kda_order[n] for n in g.layer_names]
        first = next(iter(self._mla.values()))[0]
        self._device = first.device
        if self._device.type == "cuda":
            factory = self._stream_factory or (lambda: torch.cuda.Stream(device=self._device))
            self._stream = factory()

    def hasher(self, salt: str) -> BlockHasher:
        h = self._hashers.get(salt)
        if h is None:
            h = self._hashers[salt] = BlockHasher(self.geo.block_size, KeyExtras(self.geo.layout.model_id, cache_salt=salt))
        return h

    # ---- loads ----------------------------------------------------------------
    def start_loads(self, loads: list[LoadJob]) -> None:
        """Fetch, verify and scatter every load job (``start_load_kv``)."""
        for job in loads:
            ok = False
            try:
                ok = self._load(job)
            except Exception:  # a tier or transport failure is a miss (NOTE 2)
                log.exception("load of %s failed; vLLM will recompute", job.req_id)
            self.counters["loads"] += 1
            self._done_recving.add(job.req_id)
            if not ok:
                self.counters["load_failures"] += 1
                self._failed_recving.add(job.req_id)
                self._error_blocks.update(b for pages in job.mla_block_ids.values() for b in pages)
                self._error_blocks.update(job.kda_block_ids.values())

    def _load(self, job: LoadJob) -> bool:
        geo, S = self.geo, self.geo.block_size
        if not job.kda_block_ids and geo.kda_groups or not job.mla_block_ids:
            return False  # an unplannable load (the scheduler logged why)
        store = self.stores.get(job.source_dcp_size, job.peer)
        state = store.load_state(job.token_ids, job.position, self.hasher(job.cache_salt), geo.layout,
                                 first_block=job.first_block, dcp_size=geo.dcp_size, dcp_rank=self.dcp_rank,
                                 tp_ranks=[self.tp_rank])
        self._report.events.extend(self.stores.event_log.take())
        if state is None:
            return False
        n_full = job.position // S
        rows = geo.mla_rows
        parts = [b.rows for b in state.mla_blocks]
        tail_rows = state.tail.rows if state.tail is not None else None
        handles: list[CopyHandle] = []
        for gid, views in self._mla.items():
            slots = self._mla_slots[gid]
            pages = job.mla_block_ids[gid]
            assert len(pages) == math.ceil(job.position / S) - job.first_block, "pages do not cover the load"
            if parts:
                staging = torch.cat([p[slots] for p in parts], dim=1) if len(parts) > 1 else parts[0][slots]
                handles.append(scatter_blocks(staging.contiguous(), views, pages[: n_full - job.first_block],
                                              self._stream))
            if tail_rows is not None:
                page = pages[-1]
                count = tail_rows.shape[1]
                assert count <= rows, "tail rows overflow the page"
                for view, slot in zip(views, slots, strict=True):
                    _raw(view[page, :count]).copy_(_raw(tail_rows[slot]).to(view.device))
        if geo.kda_groups:
            (kda,) = state.kda
            conv = kda.conv.transpose(-1, -2) if geo.conv_transposed else kda.conv
            for gid, (convs, ssms) in self._kda.items():
                slots = self._kda_slots[gid]
                block = [job.kda_block_ids[gid]]
                handles.append(scatter_slots(conv[slots].unsqueeze(1).contiguous(), convs, block, self._stream))
                handles.append(scatter_slots(kda.recurrent[slots].unsqueeze(1).contiguous(), ssms, block, self._stream))
        for h in handles:  # a loaded request is scheduled next step: its bytes must be in place
            h.wait()
        nbytes = sum(p.nbytes for p in parts) + (tail_rows.nbytes if tail_rows is not None else 0)
        nbytes += sum(k.conv.nbytes + k.recurrent.nbytes for k in state.kda)
        self.counters["bytes_loaded"] += nbytes
        self._report.loaded_bytes += nbytes
        return True

    # ---- saves ------------------------------------------------------------------
    def begin_saves(self, saves: list[SaveJob]) -> None:
        """Bind this step's save jobs (before the forward)."""
        S = self.geo.block_size
        for job in saves:
            n_full = job.position // S
            write = self.writes_mla
            keep = (n_full - job.first_block) if write else 0  # full blocks this rank gathers
            pages = {}
            for gid, ids in job.mla_block_ids.items():
                sel = ids[:keep]
                if job.position % S:
                    sel = sel + [ids[-1]]  # the tail page (every rank: dedup by key)
                pages[gid] = sel
            self._work.append(_SaveWork(job, write, pages))

    def _gather_layer(self, work: _SaveWork, gid: int, j: int) -> None:
        view = self._mla[gid][j]
        slot = self._mla_slots[gid][j]
        pages = work.pages[gid]
        if slot in work.gathered or not pages:
            work.gathered.add(slot)
            return
        if work.mla_rows is None:
            lay = self.geo.layout
            work.mla_rows = alloc_staging((lay.num_mla_layers, len(pages) * self.geo.mla_rows, lay.latent_dim),
                                          view.dtype)
        _, handle = gather_blocks([view], pages, work.mla_rows[slot: slot + 1], self._stream)
        work.handles.append(handle)
        work.gathered.add(slot)

    def save_layer(self, layer_name: str) -> None:
        """After MLA layer ``layer_name`` ran: gather its pages for this step's saves (``save_kv_layer``)."""
        for gid in self._mla:
            names = next(g.layer_names for g in self.geo.groups if g.group_id == gid)
            if layer_name in names:
                j = names.index(layer_name)
                for work in self._work:
                    self._gather_layer(work, gid, j)
                return

    def finish_saves(self) -> None:
        """Gather what is left (KDA states, MLA layers not seen) and put (``wait_for_save``)."""
        work, self._work = self._work, []
        for w in work:
            try:
                for gid, views in self._mla.items():
                    for j in range(len(views)):
                        self._gather_layer(w, gid, j)
                kda = self._gather_kda(w) if self.geo.kda_groups else self._empty_kda(w.job.position)
            except Exception:
                log.exception("gather for %r failed", w.job)
                self._complete(w.job, None)
                continue
            if self._pool is None:
                self._complete(w.job, self._put(w, kda))
            else:
                self._futures.append((w.job, self._pool.submit(self._put, w, kda)))

    def _gather_kda(self, w: _SaveWork) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.geo.layout
        conv = alloc_staging((lay.num_kda_layers, 1, *self.geo.conv_shape), self.geo.state_dtypes[0])
        rec = alloc_staging((lay.num_kda_layers, 1, *self.geo.state_shape), self.geo.state_dtypes[1])
        for gid, (convs, ssms) in self._kda.items():
            slots = self._kda_slots[gid]
            block = [w.job.kda_block_ids[gid]]
            c, hc = gather_slots(convs, block, stream=self._stream)
            s, hs = gather_slots(ssms, block, stream=self._stream)
            hc.wait()
            hs.wait()
            idx = torch.tensor(slots)
            _raw(conv).index_copy_(0, idx, _raw(c))
            _raw(rec).index_copy_(0, idx, _raw(s))
        conv = conv[:, 0]
        return (conv.transpose(-1, -2).contiguous() if self.geo.conv_transposed else conv), rec[:, 0]

    def _empty_kda(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.geo.layout
        return (torch.empty((0, lay.conv_width - 1, 0), dtype=getattr(torch, lay.conv_dtype)),
                torch.empty((0, 0, lay.head_k, lay.head_v), dtype=getattr(torch, lay.state_dtype)))

    def _put(self, w: _SaveWork, kda: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Build the objects of one save and put them; returns encoded bytes written."""
        for h in w.handles:
            h.wait()
        geo, job, S = self.geo, w.job, self.geo.block_size
        d, r = geo.dcp_size, self.dcp_rank
        n_full = job.position // S
        rows = geo.mla_rows
        blocks, tail = [], None
        if w.mla_rows is not None:
            n_blocks = n_full - job.first_block if w.write_mla else 0
            for i in range(n_blocks):
                start = (job.first_block + i) * S
                blocks.append(MLABlock(w.mla_rows[:, i * rows: (i + 1) * rows], start, S, d, r))
            if job.position % S:
                span = job.position % S
                count = dcp_positions(n_full * S, span, d, r).numel()
                tail = MLABlock(w.mla_rows[:, n_blocks * rows: n_blocks * rows + count], n_full * S, span, d, r)
        first = job.first_block if blocks else n_full
        conv, rec = kda
        ckpt = KDACheckpoint(conv, rec, job.position, self.tp_rank, geo.tp_size)
        state = ResumeState(geo.layout, job.position, blocks, first, tail, [ckpt])
        result = self.stores.own.put_state(job.token_ids, state, self.hasher(job.cache_salt), tp_rank=self.tp_rank)
        with self._lock:
            self.counters["objects_saved"] += result.num_stored
            self.counters["objects_skipped"] += result.num_skipped
            self.counters["bytes_saved"] += result.bytes_stored
        if result.num_refused:
            raise RuntimeError(f"{result.num_refused} objects of {job!r} refused by every tier (full)")
        return result.bytes_stored

    def _complete(self, job: SaveJob, nbytes: int | None) -> None:
        with self._lock:
            rep = self._report
            if nbytes is None:
                self.counters["save_failures"] += 1
                rep.failed_saves[job.job_id] = rep.failed_saves.get(job.job_id, 0) + 1
            else:
                self.counters["saves"] += 1
                rep.saved_bytes += nbytes
                rep.completed_saves[job.job_id] = rep.completed_saves.get(job.job_id, 0) + 1
            if job.finish:
                self._done_sending.add(job.req_id)

    def _collect(self, wait: bool = False) -> None:
        pending = []
        for job, fut in self._futures:
            if not (wait or fut.done()):
                pending.append((job, fut))
                continue
            try:
                self._complete(job, fut.result())
            except Exception:
                log.exception("save of %r failed; the state will be recomputed when needed", job)
                self._complete(job, None)
        self._futures = pending

    # ---- results ------------------------------------------------------------------
    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        self._collect()
        with self._lock:
            out = (self._done_sending, self._done_recving, self._failed_recving)
            self._done_sending, self._done_recving, self._failed_recving = set(), set(), set()
        return out

    def error_blocks(self) -> set[int]:
        """Blocks of failed loads since the last call (NOTE 2)."""
        out, self._error_blocks = self._error_blocks, set()
        return out

    def take_report(self) -> WorkerReport | None:
        with self._lock:
            self._report.events.extend(self.stores.event_log.take())
            rep, self._report = self._report, WorkerReport()
        empty = not (rep.completed_saves or rep.failed_saves or rep.events or rep.saved_bytes or rep.loaded_bytes)
        return None if empty else rep

    def has_pending_saves(self) -> bool:
        return bool(self._futures) or bool(self._work)

    def drain(self) -> None:
        """Wait for every save in flight (shutdown, tests)."""
        self._collect(wait=True)

    def shutdown(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
