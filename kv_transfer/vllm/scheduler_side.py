"""Scheduler side of the K3 state connector: lookups, load plans, save jobs, pins.

Runs in vLLM's engine-core process next to the ``Scheduler``. It never touches
tensor bytes: it answers "how many tokens can be loaded", turns vLLM's block
tables into ``LoadJob``s / ``SaveJob``s for the workers, and keeps the blocks a
save reads alive until every worker has reported the save done.

    lookup    resumable_length(tokens) over the node's tiers: the furthest p with
              every MLA block before p AND the KDA checkpoint at p (all TP shards)
    load      async (vLLM's WAITING_FOR_REMOTE_KVS): the workers report
              finished_recving, or failed_recving -> vLLM recomputes the prompt
    save      finish      a finished request's state at its last computed token
                          (prefill end = P/D hand-off, turn end = next turn's resume)
              boundary    vLLM's mamba "align" checkpoints (kv_connector_block_state)
              partial_tail  register_finished_partial_tail: an unaligned boundary

NOTES
1. A reported hit p is a complete resume point in the store at lookup time, and
   p > the block-aligned local hit vLLM passed in; p < len(tokens) (at least one
   token is computed).
2. Blocks of a finish save stay allocated through vLLM's delayed free (we return
   delay_free=True and every worker reports the request in finished_sending);
   blocks of boundary and partial-tail saves are pinned here (BlockPool.touch)
   and unpinned when all ``world_size`` workers reported the job.
3. A save never gathers a block the store already holds (``first_block``).
4. A request whose ``kv_transfer_params`` carry ``NO_SAVE_KEY`` is saved at no point
   (finish, boundary, partial tail; counted ``saves_declined``): a session's last turn,
   whose client said nothing will resume it (``disagg.flow`` NOTE 13). A P/D prefill
   never carries it: its finish save is the hand-off.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from kv_transfer.keys import BlockHasher, KeyExtras, ObjectKey, dcp_shard
from kv_transfer.store import ResumePoint
from kv_transfer.vllm.geometry import CacheGeometry
from kv_transfer.vllm.jobs import NO_SAVE_KEY, LoadJob, SaveJob, StateHandle, WorkerReport
from kv_transfer.vllm.stores import StoreSet

log = logging.getLogger(__name__)
NULL_BLOCK = 0  # vLLM's null block id (a skipped or absent block)
SAVE_BOUNDARIES = ("prompt", "all", "none")


@dataclass(slots=True)
class _Lookup:
    point: ResumePoint  # what the store holds for the request
    num_computed: int  # block-aligned local hit vLLM passed in
    source_dcp_size: int  # DCP size of the stored state
    peer: str  # "" or the producer node's state server


@dataclass(slots=True)
class SchedulerOptions:
    """Knobs of the scheduler side (from ``kv_connector_extra_config``)."""

    can_load: bool = True  # kv_consumer / kv_both
    can_save: bool = True  # kv_producer / kv_both
    world_size: int = 1  # workers reporting each save (TP ranks)
    save_boundaries: str = "prompt"  # which vLLM boundary checkpoints to save: prompt | all | none
    min_save_tokens: int = 1  # do not save states shorter than this
    handle_wait_s: float = 5.0  # how long a consumer waits for a producer's in-flight save
    engine_id: str = ""  # this engine (handles, events)
    peer_address: str = ""  # this node's state server, advertised in handles ("" = same node only)

    def __post_init__(self) -> None:
        if self.save_boundaries not in SAVE_BOUNDARIES:
            raise ValueError(f"save_boundaries must be one of {SAVE_BOUNDARIES}, got {self.save_boundaries!r}")
        if self.world_size < 1 or self.min_save_tokens < 1 or self.handle_wait_s < 0:
            raise ValueError("world_size and min_save_tokens must be >= 1, handle_wait_s >= 0")


class SchedulerSide:
    """Plans the connector's loads and saves for one engine."""

    def __init__(self, geometry: CacheGeometry, stores: StoreSet, options: SchedulerOptions):
        self.geo, self.stores, self.opts = geometry, stores, options
        self.block_size = geometry.block_size
        self._hashers: dict[str, BlockHasher] = {}
        self._pool = None  # vLLM BlockPool, for pins
        self._requests: dict[str, object] = {}  # live vLLM Requests (on_new_request)
        self._lookups: dict[str, _Lookup] = {}
        self._handle_seen: dict[str, float] = {}  # req id -> monotonic time a handle was first waited on
        self._loaded: dict[str, int] = {}  # req id -> position loaded (no re-save of the same state)
        self._tail_saved: dict[str, int] = {}  # req id -> partial-tail position already queued
        self._loads: list[LoadJob] = []
        self._saves: list[SaveJob] = []
        self._pinned: dict[int, tuple[list[int], int]] = {}  # job id -> (pinned block ids, ranks to report)
        self._finish_jobs: dict[int, str] = {}  # job id -> request (delayed free, NOTE 2)
        self._events: deque = deque(maxlen=65536)
        self._next_job = 0
        self.counters = dict.fromkeys(("lookups", "hits", "hit_tokens", "waits", "loads", "saves_finish",
                                       "saves_boundary", "saves_partial_tail", "save_failures",
                                       "saves_skipped", "saves_declined"), 0)

    # ---- helpers --------------------------------------------------------
    def hasher(self, cache_salt: str | None) -> BlockHasher:
        salt = cache_salt or ""
        h = self._hashers.get(salt)
        if h is None:
            h = self._hashers[salt] = BlockHasher(self.block_size, KeyExtras(self.geo.layout.model_id, cache_salt=salt))
        return h

    def bind_block_pool(self, pool) -> None:
        self._pool = pool

    @staticmethod
    def _tokens(request, n: int | None = None) -> list[int]:
        ids = request.all_token_ids
        return list(ids[: len(ids) if n is None else n])

    def _stored_blocks(self, tokens: list[int], hasher: BlockHasher) -> int:
        """Leading full MLA blocks of ``tokens`` every DCP shard of which is stored."""
        digests = hasher.block_hashes(tokens)
        d = self.geo.dcp_size
        shards = [dcp_shard(r, d) for r in range(d)] if d > 1 else [""]
        keys = [ObjectKey("mla", h, s) for h in digests for s in shards]
        flags = self.stores.own.contains_keys(keys) if keys else []
        n = 0
        while n < len(digests) and all(flags[n * len(shards): (n + 1) * len(shards)]):
            n += 1
        return n

    def _pages(self, block_ids, position: int, first_block: int) -> dict[int, list[int]] | None:
        """MLA pages for blocks first_block .. ceil(position / S) - 1 per MLA group (None: a null page)."""
        last = math.ceil(position / self.block_size)
        out = {}
        for g in self.geo.mla_groups:
            table = list(block_ids[g.group_id])
            if len(table) < last:
                return None
            pages = table[first_block:last]
            if NULL_BLOCK in pages:
                return None
            out[g.group_id] = pages
        return out

    def _kda_blocks(self, block_ids, position: int) -> dict[int, int] | None:
        idx = self.geo.kda_block_index(position)
        out = {}
        for g in self.geo.kda_groups:
            table = block_ids[g.group_id]
            if idx >= len(table) or table[idx] == NULL_BLOCK:
                return None
            out[g.group_id] = table[idx]
        return out

    def _new_job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def _pin(self, job: SaveJob) -> None:
        ids = list(dict.fromkeys([b for pages in job.mla_block_ids.values() for b in pages]
                                 + list(job.kda_block_ids.values())))
        if self._pool is not None and ids:
            self._pool.touch([self._pool.blocks[b] for b in ids])
        self._pinned[job.job_id] = (ids, self.opts.world_size)

    # ---- lookup and load --------------------------------------------------
    def num_matched(self, request, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: (tokens to load, async) or (None, False) to ask again."""
        if not self.opts.can_load:
            return 0, False
        rid = request.request_id
        tokens = self._tokens(request, request.num_tokens)
        max_p = len(tokens) - 1
        if max_p <= num_computed:
            return 0, False
        handle = StateHandle.from_params(getattr(request, "kv_transfer_params", None))
        dcp_src, peer = self.geo.dcp_size, ""
        if handle is not None:
            if (handle.model_id, handle.block_size, handle.tp_size) != (
                    self.geo.layout.model_id, self.block_size, self.geo.tp_size):
                log.warning("request %s: handle from another layout (%s/%d/tp%d); recomputing", rid,
                            handle.model_id, handle.block_size, handle.tp_size)
                handle = None
            else:
                dcp_src, peer = handle.dcp_size, handle.peer
        store = self.stores.get(dcp_src, peer or None)
        hasher = self.hasher(getattr(request, "cache_salt", None))
        self.counters["lookups"] += 1
        if handle is not None and handle.position <= len(tokens):
            ready = store.resumable_length(tokens, hasher, handle.position).position >= handle.position
            if not ready:
                first = self._handle_seen.setdefault(rid, time.monotonic())
                if time.monotonic() - first < self.opts.handle_wait_s:
                    self.counters["waits"] += 1
                    return None, False  # the producer's save is still in flight: ask again next step
                log.warning("request %s: state of %s not stored after %.1fs; using what is there",
                            rid, handle.producer or "the producer", self.opts.handle_wait_s)
        point = store.resumable_length(tokens, hasher, max_p)
        if point.position <= num_computed:
            self._lookups.pop(rid, None)
            return 0, False
        self._lookups[rid] = _Lookup(point, num_computed, dcp_src, peer)
        self.counters["hits"] += 1
        return point.position - num_computed, True

    def hit_sources(self, request) -> str | None:
        """Slowest tier of the planned load ("host", "disk", "remote:..."), for vLLM's hit metrics."""
        lookup = self._lookups.get(request.request_id)
        return None if lookup is None else lookup.point.slowest_tier

    def after_alloc(self, request, block_ids, num_external: int) -> None:
        """vLLM's ``update_state_after_alloc``: turn the lookup into a ``LoadJob``."""
        rid = request.request_id
        self._handle_seen.pop(rid, None)
        lookup = self._lookups.pop(rid, None)
        if num_external <= 0 or lookup is None:
            return
        position = lookup.num_computed + num_external
        first_block = lookup.num_computed // self.block_size
        mla = self._pages(block_ids, position, first_block)
        kda = self._kda_blocks(block_ids, position)
        if position != lookup.point.position or mla is None or kda is None:
            # vLLM trimmed the hit or gave no room: a load of state we do not hold fails (-> recompute)
            log.warning("request %s: load plan for %d tokens does not match the stored point %d",
                        rid, position, lookup.point.position)
            mla, kda = {}, {}
        self._loads.append(LoadJob(rid, self._tokens(request, position), getattr(request, "cache_salt", None) or "",
                                   position, first_block, mla, kda, lookup.source_dcp_size, lookup.peer or None))
        self._loaded[rid] = position
        self.counters["loads"] += 1
        self.counters["hit_tokens"] += num_external

    # ---- saves --------------------------------------------------------------
    def _save_job(self, request, block_ids, position: int, reason: str, kda_blocks: dict[int, int] | None = None,
                  finish: bool = False) -> SaveJob | None:
        if position < self.opts.min_save_tokens or position > len(request.all_token_ids):
            return None
        if (getattr(request, "kv_transfer_params", None) or {}).get(NO_SAVE_KEY):  # NOTE 4
            self.counters["saves_declined"] += 1
            return None
        tokens = self._tokens(request, position)
        hasher = self.hasher(getattr(request, "cache_salt", None))
        first_block = min(self._stored_blocks(tokens[: position // self.block_size * self.block_size], hasher),
                          position // self.block_size)
        mla = self._pages(block_ids, position, first_block)
        kda = kda_blocks if kda_blocks is not None else self._kda_blocks(block_ids, position)
        if mla is None or kda is None or len(kda) != len(self.geo.kda_groups):
            self.counters["saves_skipped"] += 1
            log.debug("request %s: no blocks for a %s save at %d", request.request_id, reason, position)
            return None
        job = SaveJob(self._new_job_id(), request.request_id, tokens, getattr(request, "cache_salt", None) or "",
                      position, first_block, mla, kda, finish, reason)
        self._saves.append(job)
        self.counters[f"saves_{reason}"] += 1
        return job

    def on_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        """vLLM's ``request_finished_all_groups``: save the finished state, maybe hand it off."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._lookups.pop(rid, None)
        self._handle_seen.pop(rid, None)
        loaded = self._loaded.pop(rid, 0)
        tail_at = self._tail_saved.pop(rid, None)
        params = getattr(request, "kv_transfer_params", None) or {}
        if not self.opts.can_save:
            return False, None
        position = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        job = None
        if position > loaded and position != tail_at:
            job = self._save_job(request, block_ids, position, "finish", finish=True)
            if job is not None:
                self._finish_jobs[job.job_id] = rid
        stored = job is not None or position in (loaded, tail_at)
        out = None
        if params.get("do_remote_decode") and stored and position > 0:
            out = StateHandle(position, self.geo.tp_size, self.geo.dcp_size, self.geo.layout.model_id,
                              self.block_size, self.opts.peer_address, self.opts.engine_id,
                              StateHandle.now()).to_params()
        return job is not None, out

    def on_partial_tail(self, request, block_ids, offloads) -> bool:
        """vLLM's ``register_finished_partial_tail``: save the unaligned boundary state now."""
        if not self.opts.can_save or not offloads:
            return False
        boundaries = {b for _, _, b in offloads}
        if len(boundaries) != 1:
            raise ValueError(f"partial-tail offloads of one request at several boundaries: {sorted(boundaries)}")
        boundary = boundaries.pop()
        kda = {gid: block for gid, block, _ in offloads}
        if set(kda) != set(self.geo.group_ids("kda")) or NULL_BLOCK in kda.values():
            return False
        job = self._save_job(request, block_ids, boundary, "partial_tail", kda_blocks=kda)
        if job is None:
            return False
        self._pin(job)  # the request's blocks are freed right after this call (NOTE 2)
        self._tail_saved[request.request_id] = boundary
        return False

    def _boundary_saves(self, block_state) -> None:
        if block_state is None or not block_state.boundary_state_offloads or self.opts.save_boundaries == "none":
            return
        for rid, entries in block_state.boundary_state_offloads.items():
            request = self._requests.get(rid)
            block_ids = block_state.get_block_ids(rid)
            if request is None or block_ids is None:
                continue
            by_boundary: dict[int, dict[int, int]] = {}
            for gid, block, boundary in entries:
                by_boundary.setdefault(boundary, {})[gid] = block
            for boundary, kda in sorted(by_boundary.items()):
                if self.opts.save_boundaries == "prompt" and boundary > request.num_prompt_tokens:
                    continue
                if set(kda) != set(self.geo.group_ids("kda")) or NULL_BLOCK in kda.values():
                    continue
                job = self._save_job(request, block_ids, boundary, "boundary", kda_blocks=kda)
                if job is not None:
                    self._pin(job)

    def build(self, scheduler_output) -> tuple[list[LoadJob], list[SaveJob]]:
        """Jobs for this step's ``build_connector_meta``; resets the pending lists."""
        if self.opts.can_save:
            self._boundary_saves(getattr(scheduler_output, "kv_connector_block_state", None))
        loads, saves = self._loads, self._saves
        self._loads, self._saves = [], []
        return loads, saves

    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request

    # ---- worker reports -----------------------------------------------------
    def on_report(self, report: WorkerReport) -> None:
        """Account the workers' completed saves: unpin when every rank is done (NOTE 2)."""
        for counts in (report.completed_saves, report.failed_saves):
            for job_id, n in counts.items():
                self._finish_jobs.pop(job_id, None)
                pinned = self._pinned.get(job_id)
                if pinned is None:
                    continue
                ids, remaining = pinned
                remaining -= n
                if remaining > 0:
                    self._pinned[job_id] = (ids, remaining)
                    continue
                del self._pinned[job_id]
                if self._pool is not None and ids:
                    self._pool.free_blocks(self._pool.blocks[b] for b in reversed(ids))
        self.counters["save_failures"] += sum(report.failed_saves.values())
        self._events.extend(report.events)

    def take_events(self) -> list:
        out = list(self._events)
        self._events.clear()
        return out

    def has_pending_work(self) -> bool:
        """Saves holding pinned blocks keep the engine stepping until workers report them."""
        return bool(self._pinned) or bool(self._saves) or bool(self._finish_jobs)

    def num_pinned_jobs(self) -> int:
        return len(self._pinned)
