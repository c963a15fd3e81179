"""Typed options of the vLLM backend (``engine.vllm`` in an ``AppConfig``) and the engine args they make.

    engine:
      backend: vllm
      block_size: 256                 # = vLLM's scheduler block (keys of router and connector agree)
      max_num_seqs: 64
      max_num_batched_tokens: 16384
      vllm:
        model: moonshotai/Kimi-K3      # HF id or local dir (default: model.name)
        env: {VLLM_ROCM_USE_AITER: "1"}   # set in the replica before the engine starts
        engine_args:                   # any vLLM AsyncEngineArgs field, both roles
          tensor_parallel_size: 8
          kv_cache_dtype: fp8
          speculative_config: {method: mtp, num_speculative_tokens: 3}
        prefill: {}                    # per-role overrides of engine_args
        decode: {decode_context_parallel_size: 8}
        connector: {save_boundaries: prompt, min_save_tokens: 256}

Roles: both deployments are ``kv_both``: a prefill engine resumes from the
node's stored prefixes and saves what it computed (the hand-off); a decode
engine loads hand-offs and resumable prefixes and saves each turn's end for the
next turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from disagg.config import AppConfig

CONNECTOR_CLASS = "K3StateConnector"
CONNECTOR_MODULE = "kv_transfer.vllm_connector"
ROLES = {"prefill": "kv_both", "decode": "kv_both"}
_OWNED = ("model", "kv_transfer_config", "block_size")  # set from the AppConfig, not engine_args


class ConnectorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    save_boundaries: Literal["prompt", "all", "none"] = "prompt"  # vLLM checkpoints to save
    min_save_tokens: int | None = None  # default: one block
    handle_wait_s: float | None = None  # default: transfer.load_deadline_s
    serve_address: str | None = None  # "0.0.0.0:0": serve this node's host tier to other nodes
    advertise_host: str | None = None  # address peers use (default: this node's IP)
    async_saves: bool = True  # encode + put on a worker thread


class VLLMOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # HF id or directory (default: AppConfig.model.name)
    env: dict[str, str] = Field(default_factory=dict)  # environment of the engine processes
    engine_args: dict[str, Any] = Field(default_factory=dict)  # AsyncEngineArgs fields, both roles
    prefill: dict[str, Any] = Field(default_factory=dict)  # overrides for the prefill role
    decode: dict[str, Any] = Field(default_factory=dict)  # overrides for the decode role
    connector: ConnectorOptions = Field(default_factory=ConnectorOptions)

    def role_args(self, role: str) -> dict[str, Any]:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose one of {sorted(ROLES)}")
        args = {**self.engine_args, **(self.prefill if role == "prefill" else self.decode)}
        owned = [k for k in _OWNED if k in args]
        if owned:
            raise ValueError(f"set {owned} through model / engine.block_size, not engine.vllm engine_args")
        return args


def options(app: AppConfig) -> VLLMOptions:
    """The validated ``engine.vllm`` section (ValueError on unknown keys)."""
    return VLLMOptions.model_validate(app.engine.vllm)


def model_id(app: AppConfig) -> str:
    """Key space shared by the connector and the router: served name + dtype."""
    return f"{app.model.served_name or Path(options(app).model or app.model.name).name}|{app.model.dtype}"


def parallel_sizes(app: AppConfig, role: str) -> tuple[int, int]:
    """(TP, DCP) of a role's engine."""
    args = options(app).role_args(role)
    return int(args.get("tensor_parallel_size", 1)), int(args.get("decode_context_parallel_size", 1))


def engine_kwargs(app: AppConfig, role: str, host_socket: str | None, engine_id: str) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments for one role (plain data; vLLM not imported).

    ``kv_transfer_config`` is returned as a dict of ``KVTransferConfig`` fields.
    """
    opts = options(app)
    e = app.engine
    conn = opts.connector
    extra: dict[str, Any] = {
        "model_id": model_id(app),
        "save_boundaries": conn.save_boundaries,
        "min_save_tokens": conn.min_save_tokens or e.block_size,
        "handle_wait_s": conn.handle_wait_s if conn.handle_wait_s is not None else app.transfer.load_deadline_s,
        "async_saves": conn.async_saves,
        "token_env": app.transfer.grpc.token_env,
    }
    if host_socket:
        extra["host_socket"] = host_socket
    if conn.serve_address:
        extra["serve_address"] = conn.serve_address
    if conn.advertise_host:
        extra["advertise_host"] = conn.advertise_host
    kw: dict[str, Any] = {
        "model": opts.model or app.model.name,
        "served_model_name": app.model.openai_name,
        "dtype": app.model.dtype,
        "seed": app.model.seed,
        "block_size": e.block_size,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
    }
    if e.max_model_len:
        kw["max_model_len"] = e.max_model_len
    kw.update(opts.role_args(role))
    kw["kv_transfer_config"] = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": ROLES[role],
        "kv_load_failure_policy": "recompute",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }
    return kw


def build_engine_args(app: AppConfig, role: str, host_socket: str | None, engine_id: str):
    """vLLM ``AsyncEngineArgs`` for one role (vLLM validates every field name and type)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kw = engine_kwargs(app, role, host_socket, engine_id)
    kw["kv_transfer_config"] = KVTransferConfig(**kw["kv_transfer_config"])
    return AsyncEngineArgs(**kw)
