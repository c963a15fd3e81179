"""Typed configuration of a disagg application, loaded from YAML.

One ``AppConfig`` describes the whole application: model, engine, state tiers,
router, the prefill/decode deployments and the HTTP edge. The same object is
built by ``disagg serve --config``, by ``serve run`` through
``deployments.app:build_app`` (its args are this config), and by the Helm
chart's ``serveConfigV2``.

Example (``deployments/configs/local-cpu.yaml``)::

    model: {name: tiny, dtype: float32, device: cpu}
    engine: {block_size: 64, cache_budget_mb: 256}
    transfer: {host: {capacity_mb: 1024, policy: lru}}
    deployment: {mode: disaggregated, prefill: {num_replicas: 1}, decode: {num_replicas: 1}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from disagg.costs import cost_profile

# Session retention (disagg.reuse.retention): a session's newest private KDA checkpoints kept in
# the tiers' eviction order; older ones are evicted first. The serving path and the simulator's
# retention (disagg.tools.sim.retention) both default to it.
KEEP_CHECKPOINTS = 8
KEEP_TURNS: int | str = 0  # transfer.host.keep_turns (disagg.reuse.retention NOTE 6)


def check_keep_turns(keep_turns: object) -> None:
    """``transfer.host.keep_turns`` is "auto" or an integer >= 0; ValueError otherwise."""
    if keep_turns != "auto" and (isinstance(keep_turns, bool) or not isinstance(keep_turns, int) or keep_turns < 0):
        raise ValueError(f"keep_turns must be 'auto' or an integer >= 0, got {keep_turns!r}")

# The P/D placement rule's defaults (disagg.router.decider): the one place they are set. The
# serving path (disagg.flow), the router and the simulator all build their decider from these.
# Local prefill on a decode replica stalls its whole batch for the prefill's steps: a suffix counts
# once for itself and LOCAL_HARM_WEIGHT times per decode running there (the router suite's P/D
# cells, docs/router.md).
LOCAL_PREFILL_MAX_TOKENS = 256  # a suffix weighing up to this is prefilled on the decode replica
PREFILL_BUSY_TOKENS = 65536.0  # the least-loaded prefill replica's queued tokens that count as busy
BUSY_LOCAL_MAX_TOKENS = 8192  # while the prefill pool is busy, weighted suffixes up to this prefill locally
# weighted suffix = suffix * (1 + this * the decode replica's running decodes); "local_state": a
# decode replica that resumes more of the prompt than any prefill replica prefills locally when its
# suffix * (1 + this * (its decodes running or on their way)) <= the pool's least queued + uncached
# tokens (disagg.router.decider). 16, not 4: with 4, stalls behind local prefills were most of the
# P/D cells' P90 ITL tail (docs/router.md, "Round 7")
LOCAL_HARM_WEIGHT = 16.0
# "local_idle": an idle decode replica (nothing running there nor routed to it) that resumes at least as
# much as any prefill replica prefills locally when the pool's least queued + uncached tokens are at
# least this many times its suffix (the pool's queue would at least quadruple the time to first token);
# "local_burst" uses the same margin for a session's first turn on a decode replica with nothing running
# while every prefill replica has prefill_busy_tokens queued (disagg.router.decider)
LOCAL_IDLE_MARGIN = 4.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    name: str = "tiny"  # reference preset name, or a model directory (config.json + safetensors)
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    device: str = "cpu"  # "cpu", "cuda", "cuda:0" ...
    seed: int = 0  # random init seed when no weights are given
    served_name: str | None = None  # the OpenAI model name (default: "disagg-<name>")

    @property
    def openai_name(self) -> str:
        return self.served_name or f"disagg-{Path(self.name).name}"


class EngineConfig(_Strict):
    backend: Literal["reference", "vllm"] = "reference"
    block_size: int = 64  # tokens per MLA block
    max_num_seqs: int = 16  # concurrent sequences per replica
    max_num_batched_tokens: int = 2048  # tokens per engine step
    cache_budget_mb: int = 256  # device cache budget (MLA blocks, KDA slots, kept KDA states)
    checkpoint_interval: int = 0  # extra KDA checkpoints every N tokens (0 = turn ends only)
    resident_sessions: bool = True  # keep finished sessions on the device (device tier)
    learned_checkpoints: bool = True  # extra KDA checkpoints where prompts diverge (disagg.reuse.placement)
    cuda_graphs: bool = True  # reference engine on CUDA: small steps replay their token-wise work as CUDA graphs
    decode_graphs: bool = True  # with cuda_graphs: decode-only steps replay as one graph, mixing included
    max_model_len: int | None = None  # cap on prompt + output tokens
    num_threads: int | None = None  # torch intra-op threads per replica (None = torch's default)
    vllm: dict[str, Any] = Field(default_factory=dict)  # extra vLLM engine kwargs (vllm backend)

    @field_validator("block_size")
    @classmethod
    def _block(cls, v: int) -> int:
        if v <= 0 or v % 64:
            raise ValueError("block_size must be a positive multiple of 64")
        return v


class HostTierConfig(_Strict):
    capacity_mb: int = 1024  # hard byte capacity of the node's shared host tier
    policy: Literal["lru", "s3fifo", "arc"] = "lru"  # eviction policy (kv_transfer.tiers.eviction; docs/router.md "Round 14")
    pin_memory: bool = True  # page-lock for fast device copies where a GPU exists
    # slab size of the arena's allocator (kv_transfer.tiers.allocator), KiB; 0: derived from the
    # capacity (1/32 of it, at least 64 MiB where 4 such slabs fit). A small tier (tests, CPU
    # benchmarks) with a few objects of several sizes wants more, smaller slabs
    slab_kb: int = Field(default=0, ge=0)
    # a session's newest private KDA checkpoints kept in eviction order; older ones are evicted
    # first (disagg.reuse.retention); 0: off (recency alone)
    keep_checkpoints: int = Field(default=KEEP_CHECKPOINTS, ge=0)
    # also evict first the private checkpoints of a session's turns older than its newest N: 0, no
    # limit (the default); "auto", N learned from how many turns back the sessions' prompts resume
    # (a tool loop: its latest turn only; a conversation that branches or is edited: more). Off by
    # default: it lifts agentic shapes, not yet run on every family (docs/router.md "Round 38", "Round 39")
    keep_turns: int | Literal["auto"] = KEEP_TURNS
    # also evict first the speculative checkpoints a prefill keeps for prompts that may share its
    # prefix later (the start prior's), as they land; for full host tiers where prefixes are rarely
    # shared later (`disagg sim run --explain-misses` shows what they carry; docs/router.md "Round 37")
    speculative_first: bool = False
    # the host tier as its node's devices' victim cache: it evicts first what a decoding device of
    # the node holds, and each device writes back what it evicts that the tier lacks (a full node
    # keeps host plus devices, not host alone; disagg.workers.holds). A worker that misses blocks a
    # node mate's device holds recalls them: the mate writes them back and the worker loads them
    # (kv_transfer.tiers.host NOTE 9). Unset (the default): on for the reference engine, off for an
    # engine that cannot say what it evicts (vLLM's block pool); true needs the reference engine
    # (docs/router.md "Round 43")
    victim: bool | None = None
    # with victim: how long a lookup waits for node mates to write back what it recalled (then
    # it resumes what came back, and computes the rest); with router.engine_profile, as long as
    # the profile says computing what it recalled takes, when longer (disagg.flow NOTE 16)
    recall_ms: int = Field(default=250, ge=0)

    @field_validator("keep_turns", mode="before")
    @classmethod
    def _keep_turns(cls, v: object) -> object:
        check_keep_turns(v)  # ValueError: neither "auto" nor an integer >= 0
        return v


class DiskTierConfig(_Strict):
    enabled: bool = False
    path: str = "/tmp/disagg-disk-tier"  # segment directory (local NVMe)
    capacity_gb: float = 16.0
    admission: Literal["always", "second_touch"] = "always"  # what host evictions the disk keeps


class GrpcConfig(_Strict):  # the cross-node state service (deployments.node_store; docs/reliability.md)
    enabled: bool = False  # each node store serves its host tier; decode replicas read other nodes' state
    bind: str = "127.0.0.1:0"  # host:port; empty host = the node's Ray IP (the cluster interface)
    token_env: str = "DISAGG_TRANSFER_TOKEN"  # env var holding the shared secret
    tls_cert: str | None = None  # this node's certificate (PEM path): served, and presented to peers
    tls_key: str | None = None  # its private key (PEM path)
    tls_ca: str | None = None  # CA every node's certificate chains to (PEM path); required with TLS
    max_message_mb: int = 64  # gRPC message limit on both ends
    deadline_s: float = 5.0  # deadline of each call to a peer

    @model_validator(mode="after")
    def _check(self) -> GrpcConfig:
        _, sep, port = self.bind.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"transfer.grpc.bind must be host:port (port 0 = any free one), got {self.bind!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("transfer.grpc.tls_cert and tls_key go together")
        if (self.tls_cert is None) != (self.tls_ca is None):
            raise ValueError("transfer.grpc TLS needs tls_cert, tls_key and tls_ca (nodes verify each other)")
        if self.max_message_mb < 3:
            raise ValueError("transfer.grpc.max_message_mb must be at least 3 (a 2 MiB chunk and its header)")
        if self.deadline_s <= 0 or not self.token_env:
            raise ValueError("transfer.grpc needs a positive deadline_s and a token_env")
        return self


class SpillConfig(_Strict):  # spill to the pool (deployments.node_store NOTE 2; kv_transfer.spill)
    # with transfer.grpc.enabled: a node that runs no prefill replica sends what its last tier evicts (the disk
    # tier's when enabled, else the host tier's; demoted objects aside) to a prefill node's host tier, where
    # that pool resumes it; on, as in the simulator's suite (docs/router.md, round 8)
    enabled: bool = True
    max_pending_mb: int = Field(default=256, ge=1)  # evictions queued for sending; past it they are dropped
    refresh_s: float = Field(default=10.0, gt=0)  # how often a node looks again for the prefill nodes


class TransferConfig(_Strict):
    host: HostTierConfig = Field(default_factory=HostTierConfig)
    disk: DiskTierConfig = Field(default_factory=DiskTierConfig)
    grpc: GrpcConfig = Field(default_factory=GrpcConfig)
    spill: SpillConfig = Field(default_factory=SpillConfig)
    load_deadline_s: float = 5.0  # past this, a state load gives up and the request recomputes


class RouterConfig(_Strict):
    policy: Literal["state_aware", "affinity", "power_of_two"] = "state_aware"  # Serve request router
    # scorer weights replacing every placement profile's (e.g. {prefix: 2, load: 1, affinity: 0.5}); unset: the
    # router's default profiles (disagg.router.registry.DEFAULT_PROFILES), the ones the simulator and the suite run
    weights: dict[str, float] | None = None
    # the P/D decider (disagg.router.decider): a weighted uncached suffix at or under this is prefilled on the
    # decode replica
    local_prefill_max_tokens: int = Field(default=LOCAL_PREFILL_MAX_TOKENS, ge=0)
    prefill_busy_tokens: float = Field(default=PREFILL_BUSY_TOKENS, gt=0)  # prefill pool busy: min queue >= this
    busy_local_max_tokens: int = Field(default=BUSY_LOCAL_MAX_TOKENS, ge=0)  # ... then weighted suffixes up to this
    local_harm_weight: float = Field(default=LOCAL_HARM_WEIGHT, ge=0)  # weight of a local prefill's stall
    # "local_idle" and "local_burst" (need the prefill pool's resumable tokens; 0 turns them off)
    local_idle_margin: float = Field(default=LOCAL_IDLE_MARGIN, ge=0)
    stats_period_s: float = 1.0  # how often replicas report load and device-tier content to routers
    # the replicas' engine: a cost profile's name (disagg/costs/profiles: h200-small, mi355x-k3, ...; or small,
    # large) or a JSON file (`disagg sim calibrate` writes one; read where the application is built). The
    # state-aware router then prices time with its prefill rate, decode steps, state sizes and links
    # (disagg.router.calibration); unset: the router's built-in constants, the small profile's
    engine_profile: str | None = None

    @field_validator("engine_profile")
    @classmethod
    def _known_profile(cls, v: str | None) -> str | None:
        if v is not None:
            cost_profile(v)  # ValueError: no such profile, or not one
        return v

    def decider_params(self) -> dict[str, float]:
        """The ``DeciderConfig`` fields (``disagg.router.decider``) of this config."""
        return {"local_prefill_max_tokens": self.local_prefill_max_tokens,
                "prefill_busy_tokens": self.prefill_busy_tokens,
                "busy_local_max_tokens": self.busy_local_max_tokens,
                "local_harm_weight": self.local_harm_weight,
                "local_idle_margin": self.local_idle_margin}


class ReplicaConfig(_Strict):
    num_replicas: int = 1
    min_replicas: int | None = None  # set both bounds to autoscale
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    accelerator_type: str | None = None  # e.g. "AMD-Instinct-MI355X-OAM"
    resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources, e.g. {"disagg_prefill": 1}
    tensor_parallel_size: int = 1  # GPUs per replica (a placement group bundle each)
    max_ongoing_requests: int = 64

    @model_validator(mode="after")
    def _bounds(self) -> ReplicaConfig:
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("set both min_replicas and max_replicas to autoscale")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")
        return self


class DeploymentConfig(_Strict):
    mode: Literal["disaggregated", "aggregated"] = "disaggregated"
    prefill: ReplicaConfig = Field(default_factory=ReplicaConfig)
    decode: ReplicaConfig = Field(default_factory=ReplicaConfig)
    # the ingress's max_ongoing_requests is derived from the HTTP admission gate (AppConfig NOTE 1)
    ingress: ReplicaConfig = Field(default_factory=lambda: ReplicaConfig(num_cpus=0.5))
    graceful_shutdown_timeout_s: float = 20.0
    health_check_period_s: float = 10.0
    # a decode replica lost mid-stream: continue elsewhere (disagg.stream_resume): at most this many
    # losses after progress, each outage waited out (with backoff) for at most stream_resume_timeout_s
    max_stream_resumes: int = Field(default=8, ge=0)
    stream_resume_timeout_s: float = Field(default=60.0, gt=0.0)


class HTTPConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = Field(default_factory=list)  # empty = no auth
    api_keys_file: str | None = None  # file with more keys, one a line (e.g. a mounted Kubernetes Secret)
    max_body_bytes: int = 4 << 20
    # slow clients (NOTE 1 of disagg.api.limits; the front's side: deployments.haproxy_front)
    header_timeout_s: float = Field(default=10.0, gt=0.0)  # request line + headers must arrive in this -> 408
    body_timeout_s: float = Field(default=30.0, gt=0.0)  # the whole body must arrive in this -> 408
    keep_alive_timeout_s: int = Field(default=5, ge=1)  # an idle keep-alive connection is closed after this
    max_connections_per_client: int = Field(default=256, ge=0)  # open connections per client address (0 = no cap)
    openapi: bool = False  # serve /openapi.json (behind the API key when keys are set); never /docs
    # limits (see disagg/api/limits.py); per key = per API key, or one shared key without auth
    max_concurrent_per_key: int = Field(default=0, ge=0)  # generations (and session ends) in flight per key (0 = no limit) -> 429
    rate_limit_per_key: float = Field(default=0.0, ge=0.0)  # requests/s per key, token bucket (0 = off) -> 429
    rate_burst_per_key: int = Field(default=0, ge=0)  # bucket depth (0 = max(1, rate_limit_per_key))
    max_inflight: int = Field(default=256, ge=1)  # generations running at once (all keys); the rest queue
    max_queued: int = Field(default=512, ge=0)  # waiting for a running slot; beyond -> 503 (load shedding)
    queue_timeout_s: float = Field(default=30.0, gt=0.0)  # waited this long for a slot -> 503
    max_n: int = Field(default=16, ge=1, le=128)  # choices per request (n); each takes a gate slot; above -> 400

    def with_file_keys(self) -> HTTPConfig:
        """This config with the keys of ``api_keys_file`` added to ``api_keys``.

        The file holds one key a line (blank lines and ``#`` comments skipped). It is read
        where the HTTP app starts, so the keys never travel inside the Serve config.

        Raises:
            ValueError: the file cannot be read or holds no key (auth is never silently off).
        """
        if not self.api_keys_file:
            return self
        try:
            text = Path(self.api_keys_file).read_text()
        except OSError as exc:
            raise ValueError(f"http.api_keys_file {self.api_keys_file!r} cannot be read: {exc}") from exc
        keys = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"http.api_keys_file {self.api_keys_file!r} holds no key")
        return self.model_copy(update={"api_keys": [*self.api_keys, *keys], "api_keys_file": None})


class FaultRule(_Strict):
    """One injected fault: what, how often, and to which requests (see ``disagg.faults``)."""

    fault: Literal["drop", "delay", "corrupt", "kill_decode", "kill_prefill"]
    rate: float = Field(default=0.0, ge=0.0, le=1.0)  # probability per eligible event
    nth: int = Field(default=0, ge=0)  # or: exactly the Nth eligible event of each replica (1-based)
    session_prefix: str | None = None  # only requests whose session_id starts with this
    delay_s: float = Field(default=30.0, gt=0.0)  # "delay": how long a state load stalls
    after_tokens: int = Field(default=2, ge=1)  # "kill_decode": tokens streamed before the replica dies

    @model_validator(mode="after")
    def _fires(self) -> FaultRule:
        if not self.rate and not self.nth:
            raise ValueError(f"fault rule {self.fault!r} never fires: set rate or nth")
        return self


class FaultConfig(_Strict):
    enabled: bool = False  # master switch: no rule acts while off
    seed: int = 0  # rate draws are seeded from this and the replica id
    rules: list[FaultRule] = Field(default_factory=list)
    ledger_path: str | None = None  # JSON lines, one per injected fault (outlives killed replicas)


INGRESS_HEADROOM = 64  # ingress requests beyond the gate's: /health, /metrics, /v1/models, bodies being read


class AppConfig(_Strict):
    """The whole application.

    NOTES
    1. Limits agree: an ingress replica takes at most ``max_ongoing_requests`` requests from Serve,
       and its admission gate (``disagg.api.limits.AdmissionGate``) runs ``http.max_inflight`` and
       queues ``http.max_queued`` generations. Below their sum the excess would wait in Serve's
       queue, out of sight of the gate and never shed; so the ingress's limit is derived as
       ``max_inflight + max_queued + INGRESS_HEADROOM`` unless set, and a set value below that
       is refused.
    """

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    http: HTTPConfig = Field(default_factory=HTTPConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)  # fault injection (tests, soak); off by default

    @model_validator(mode="after")
    def _limits_agree(self) -> AppConfig:
        need = ingress_max_ongoing(self.http)
        ingress = self.deployment.ingress
        if "max_ongoing_requests" not in ingress.model_fields_set:
            ingress.max_ongoing_requests = need
        elif ingress.max_ongoing_requests < need:
            raise ValueError(
                f"deployment.ingress.max_ongoing_requests {ingress.max_ongoing_requests} is below "
                f"http.max_inflight + http.max_queued + {INGRESS_HEADROOM} = {need}: requests would queue in "
                "Serve, out of sight of the admission gate, instead of being shed with 503; raise it or leave "
                "it unset (derived)")
        host = self.transfer.host
        if host.victim is None:  # the default: wherever the engine can say what it evicts
            host.victim = self.engine.backend == "reference"
        elif host.victim and self.engine.backend != "reference":
            raise ValueError("transfer.host.victim needs engine.backend 'reference': the engine must say which "
                             f"sessions it evicts before it frees them ({self.engine.backend!r} does not)")
        return self


def ingress_max_ongoing(http: HTTPConfig) -> int:
    """The requests an ingress replica must accept for its admission gate to see all overload (NOTE 1)."""
    return http.max_inflight + http.max_queued + INGRESS_HEADROOM


def load_config(source: str | Path | dict | None) -> AppConfig:
    """Build an ``AppConfig`` from a YAML file, a dict, or defaults (None).

    A serve config (``applications: [{args: ...}]``) is accepted too: its first
    application's ``args`` are taken.
    """
    if source is None:
        return AppConfig()
    if isinstance(source, dict):
        data = source
    else:
        data = yaml.safe_load(Path(source).read_text()) or {}
    if "applications" in data:
        data = data["applications"][0].get("args", {}) or {}
    return AppConfig.model_validate(data)
