"""vLLM 0.33 KV connector for Kimi K3 / Kimi Linear state: ``K3StateConnector``.

Load it with::

    KVTransferConfig(kv_connector="K3StateConnector",
                     kv_connector_module_path="kv_transfer.vllm_connector",
                     kv_role="kv_both",                        # kv_producer | kv_consumer | kv_both
                     kv_load_failure_policy="recompute",
                     kv_connector_extra_config={
                         "host_socket": "/dev/shm/...sock",     # the node's shared host tier
                         "model_id": "kimi-k3|bfloat16",        # key space shared with the router
                         "save_boundaries": "prompt",           # prompt | all | none
                         "min_save_tokens": 256,
                         "handle_wait_s": 5.0,
                         "serve_address": "0.0.0.0:0",          # optional: serve this node's tier to peers
                     })

It subclasses ``SupportsHMA`` (vLLM keeps its hybrid KV cache manager: MLA and
KDA groups) and moves MLA blocks, partial tails and KDA checkpoints through
``kv_transfer``'s store (keys, codec checksums, tiers, TP dedup, DCP reshard).
The scheduler role plans (``kv_transfer.vllm.scheduler_side``), each worker
moves its rank's bytes (``kv_transfer.vllm.worker_side``).

P/D: a prefill request with ``kv_transfer_params={"do_remote_decode": true}``
finishes with ``kv_transfer_params`` holding a ``StateHandle``; the decode
request carries them back, and its lookup waits (bounded) for that state.

This module imports vLLM at import time; nothing else in ``kv_transfer`` does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kv_transfer.vllm.events import to_vllm_events
from kv_transfer.vllm.geometry import CacheGeometry
from kv_transfer.vllm.jobs import LoadJob, SaveJob, WorkerReport
from kv_transfer.vllm.scheduler_side import SchedulerOptions, SchedulerSide
from kv_transfer.vllm.stores import StoreSet, open_tiers
from kv_transfer.vllm.worker_side import WorkerSide

log = logging.getLogger(__name__)
_HIT_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


@dataclass
class K3ConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[LoadJob] = field(default_factory=list)  # state to scatter into blocks
    saves: list[SaveJob] = field(default_factory=list)  # state to gather out of blocks


@dataclass
class K3WorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step (summed over ranks by ``aggregate``)."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, K3WorkerMetadata), f"cannot aggregate {type(other).__name__}"
        return K3WorkerMetadata(self.report.merge(other.report))


def _parallel_ranks(extra: dict[str, Any]) -> tuple[int, int]:
    """(tp_rank, dcp_rank) of this worker: vLLM's process groups, or the extra config (tests)."""
    if "tp_rank" in extra:
        return int(extra["tp_rank"]), int(extra.get("dcp_rank", 0))
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 0
    dcp = ps.get_dcp_group()
    return ps.get_tensor_model_parallel_rank(), dcp.rank_in_group


class K3StateConnector(KVConnectorBase_V1, SupportsHMA):
    """``KVConnectorBase_V1`` + ``SupportsHMA`` over ``kv_transfer`` (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("K3StateConnector needs the KVCacheConfig (vLLM >= 0.33 passes it)")
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1:
            raise ValueError("K3StateConnector does not support pipeline parallelism")
        dcp = par.decode_context_parallel_size
        if dcp > 1 and par.cp_kv_cache_interleave_size != 1:
            raise ValueError("K3StateConnector needs cp_kv_cache_interleave_size == 1 under DCP")
        if ktc.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy=%r: a failed state load fails the request; "
                        "'recompute' turns it into a recompute", ktc.kv_load_failure_policy)
        model_id = extra.get("model_id") or f"{vllm_config.model_config.model}|{vllm_config.model_config.dtype}"
        conv_layout = extra.get("conv_layout") or os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT") or "SD"
        tp = par.tensor_parallel_size
        self.geometry = CacheGeometry.from_vllm(kv_cache_config, model_id, tp_size=tp, dcp_size=dcp,
                                                conv_layout=conv_layout)
        self.engine_id = ktc.engine_id or ""
        tiers = open_tiers(extra)
        token_env = extra.get("token_env", "DISAGG_TRANSFER_TOKEN")
        self.stores = StoreSet(tiers, self.geometry.layout, tp, dcp, extra.get("worker_id", self.engine_id),
                               token_env, float(extra.get("peer_timeout_s", 5.0)))
        self._server = None
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # the metadata whose jobs the worker last started, held (not its id(): a freed step's
        # metadata can hand its address to the next step's, whose jobs would then never start)
        self._bound: K3ConnectorMetadata | None = None
        if role == KVConnectorRole.SCHEDULER:
            peer = ""
            if extra.get("serve_address") and ktc.is_kv_producer:
                peer = self._serve(tiers[0], extra["serve_address"], token_env, extra.get("advertise_host"))
            self._sched = SchedulerSide(self.geometry, self.stores, SchedulerOptions(
                can_load=ktc.is_kv_consumer, can_save=ktc.is_kv_producer, world_size=par.world_size,
                save_boundaries=extra.get("save_boundaries", "prompt"),
                min_save_tokens=int(extra.get("min_save_tokens", 1)),
                handle_wait_s=float(extra.get("handle_wait_s", 5.0)), engine_id=self.engine_id,
                peer_address=peer))
        else:
            tp_rank, dcp_rank = _parallel_ranks(extra)
            self._worker = WorkerSide(self.geometry, self.stores, tp_rank, dcp_rank,
                                      async_saves=bool(extra.get("async_saves", True)))

    def _serve(self, tier, address: str, token_env: str, advertise_host: str | None) -> str:
        from kv_transfer.transport import StateServer, StateServerConfig

        token = os.environ.get(token_env, "")
        if not token:
            raise ValueError(f"serve_address needs a shared secret in ${token_env}")
        self._server = StateServer(tier, StateServerConfig(token=token, address=address))
        port = self._server.start()
        if not advertise_host:
            from vllm.utils.network_utils import get_ip

            advertise_host = get_ip()
        return f"{advertise_host}:{port}"

    # ---- scheduler side -----------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        if self._sched is not None:
            self._sched.bind_block_pool(gpu_block_pool)

    def on_new_request(self, request) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None, "scheduler-side call on a worker connector"
        return self._sched.num_matched(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        if num_external_tokens == 0:
            return {}
        tier = self._sched.hit_sources(request) if self._sched is not None else None
        source = _HIT_SOURCES.get(tier or "", CacheHitSource.P2P if tier else CacheHitSource.EXTERNAL_UNSPECIFIED)
        return {source: num_external_tokens}

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        assert self._sched is not None, "scheduler-side call on a worker connector"
        if num_external_tokens > 0:
            self._sched.after_alloc(request, blocks.get_block_ids(), num_external_tokens)
        else:
            self._sched.after_alloc(request, (), 0)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self._sched is not None, "scheduler-side call on a worker connector"
        loads, saves = self._sched.build(scheduler_output)
        return K3ConnectorMetadata(loads, saves)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None, "scheduler-side call on a worker connector"
        return self._sched.on_finished(request, block_ids)

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads) -> bool:
        assert self._sched is not None, "scheduler-side call on a worker connector"
        return self._sched.on_partial_tail(request, block_ids, partial_tail_offloads)

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._sched is not None and isinstance(meta, K3WorkerMetadata):
            self._sched.on_report(meta.report)

    def take_events(self):
        if self._sched is None:
            return ()
        return to_vllm_events(self._sched.take_events(), self.geometry.block_size)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    # ---- worker side ------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        assert self._worker is not None, "worker-side call on the scheduler connector"
        self._worker.register(kv_caches)

    def _bind(self) -> K3ConnectorMetadata | None:
        """Start this step's saves once per metadata (the first worker hook of the step)."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, K3ConnectorMetadata), f"unexpected metadata {type(meta).__name__}"
        if self._bound is not meta:
            self._bound = meta
            self._worker.begin_saves(meta.saves)
            self._worker.start_loads(meta.loads)
        return meta

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._bind()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are async for vLLM (WAITING_FOR_REMOTE_KVS): their scatters complete before
        # finished_recving is reported, so no layer of a forward ever waits on one.
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if self._bind() is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._bind() is not None:
            self._worker.finish_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._worker.results()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.results()
        if self.geometry.num_kv_groups == 1:
            failed = set()  # one group: vLLM takes block ids (get_block_ids_with_load_errors)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed loads. vLLM 0.33 maps block ids back to requests only with one KV
        cache group; hybrid (MLA + KDA) layouts get the failure as failed_recving instead."""
        if self._worker is None:
            return set()
        blocks = self._worker.error_blocks()
        return blocks if self.geometry.num_kv_groups == 1 else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        report = self._worker.take_report()
        return None if report is None else K3WorkerMetadata(report)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._server is not None:
            self._server.stop()
        self.stores.close()
