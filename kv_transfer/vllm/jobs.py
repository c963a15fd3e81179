"""Messages between the connector's scheduler side and its workers, and the P/D handle.

The scheduler side decides *which* blocks move; every worker (one per TP rank)
moves *its* bytes: the MLA latent once per TP group (``tp_rank < dcp_size``
writes, one writer per DCP shard), its own KDA head shard always.

    LoadJob   store -> blocks   state at ``position`` into the request's blocks
    SaveJob   blocks -> store   state at ``position`` out of the given blocks

    position p     0        S        2S     p
    MLA pages      | blk 0  | blk 1  | tail |        mla_block_ids[g][i] = page of block first_block + i
    KDA state      state after p tokens       kda_block_ids[g] = block holding it, per KDA group

``StateHandle`` is what rides in ``kv_transfer_params`` from a producer
(prefill) to a consumer (decode): where the state is and how it was sharded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

HANDLE_KEY = "disagg_state"  # our entry in vLLM's kv_transfer_params
NO_SAVE_KEY = "disagg_no_save"  # kv_transfer_params: save nothing of this request (scheduler side NOTE 4)


@dataclass(slots=True, repr=False)
class LoadJob:
    """Load the stored state at ``position`` into a request's blocks (every rank)."""

    req_id: str  # vLLM request id
    token_ids: list[int]  # tokens[:position] (keys are computed from them)
    cache_salt: str  # tenant salt entering every key
    position: int  # resume point: tokens whose state is loaded
    first_block: int  # first layout block to load (earlier blocks are local hits)
    mla_block_ids: dict[int, list[int]]  # MLA group id -> pages for blocks first_block .. ceil(p/S)-1
    kda_block_ids: dict[int, int]  # KDA group id -> block receiving the state at position
    source_dcp_size: int = 1  # DCP size the state was written with (resharded on load)
    peer: str | None = None  # gRPC address of the node holding the state ("" or None: local tiers)

    def __repr__(self) -> str:  # no tokens in logs
        return (f"LoadJob({self.req_id!r}, position={self.position}, first_block={self.first_block}, "
                f"mla={self.mla_block_ids}, kda={self.kda_block_ids}, dcp_src={self.source_dcp_size})")


@dataclass(slots=True, repr=False)
class SaveJob:
    """Save the state at ``position`` out of the given blocks (every rank, its own shard)."""

    job_id: int  # unique per scheduler; workers report completion by it
    req_id: str  # vLLM request id
    token_ids: list[int]  # tokens[:position]
    cache_salt: str  # tenant salt entering every key
    position: int  # resume point saved
    first_block: int  # blocks before it are already stored (not gathered again)
    mla_block_ids: dict[int, list[int]]  # MLA group id -> pages for blocks first_block .. ceil(p/S)-1
    kda_block_ids: dict[int, int]  # KDA group id -> block holding the state after position tokens
    finish: bool = False  # a finished request's save: report the request in finished_sending
    reason: str = "finish"  # "finish" | "boundary" | "partial_tail" (metrics, logs)

    def __repr__(self) -> str:
        return (f"SaveJob(#{self.job_id} {self.req_id!r} {self.reason}, position={self.position}, "
                f"first_block={self.first_block}, mla={self.mla_block_ids}, kda={self.kda_block_ids})")


@dataclass(slots=True)
class WorkerReport:
    """What one worker tells the scheduler side after a step (aggregated over ranks)."""

    completed_saves: dict[int, int] = field(default_factory=dict)  # save job id -> ranks done
    failed_saves: dict[int, int] = field(default_factory=dict)  # save job id -> ranks that failed
    events: list = field(default_factory=list)  # kv_transfer StoreEvents of objects stored/dropped
    saved_bytes: int = 0  # encoded bytes written by this step's saves
    loaded_bytes: int = 0  # state bytes loaded by this step's loads

    def merge(self, other: WorkerReport) -> WorkerReport:
        out = WorkerReport(dict(self.completed_saves), dict(self.failed_saves), self.events + other.events,
                           self.saved_bytes + other.saved_bytes, self.loaded_bytes + other.loaded_bytes)
        for src, dst in ((other.completed_saves, out.completed_saves), (other.failed_saves, out.failed_saves)):
            for k, v in src.items():
                dst[k] = dst.get(k, 0) + v
        return out


@dataclass(frozen=True, slots=True)
class StateHandle:
    """The producer's answer to ``do_remote_decode``: where the consumer finds the state.

    Carried as ``kv_transfer_params[HANDLE_KEY]`` (plain JSON types only).
    """

    position: int  # tokens whose state the producer saved (the prompt length)
    tp_size: int  # producer's TP size (KDA shards stored)
    dcp_size: int  # producer's DCP size (MLA shards stored)
    model_id: str  # key space (must equal the consumer's)
    block_size: int  # layout block S (must equal the consumer's)
    peer: str = ""  # "host:port" of the producer node's state server ("" = same node's tiers)
    producer: str = ""  # producer engine id (logs)
    saved_at: float = 0.0  # wall clock when the save was scheduled

    def to_params(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """``kv_transfer_params`` for the consumer request."""
        params = {"do_remote_prefill": True, "do_remote_decode": False, HANDLE_KEY: {
            "position": self.position, "tp_size": self.tp_size, "dcp_size": self.dcp_size,
            "model_id": self.model_id, "block_size": self.block_size, "peer": self.peer,
            "producer": self.producer, "saved_at": self.saved_at}}
        if extra:
            params.update(extra)
        return params

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> StateHandle | None:
        """The handle in a request's ``kv_transfer_params``; None when absent.

        Raises:
            ValueError: a handle entry that is present but malformed.
        """
        if not params or not params.get("do_remote_prefill") or HANDLE_KEY not in params:
            return None
        h = params[HANDLE_KEY]
        try:
            return cls(int(h["position"]), int(h["tp_size"]), int(h["dcp_size"]), str(h["model_id"]),
                       int(h["block_size"]), str(h.get("peer", "")), str(h.get("producer", "")),
                       float(h.get("saved_at", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed {HANDLE_KEY} in kv_transfer_params: {exc}") from exc

    @staticmethod
    def now() -> float:
        return time.time()
