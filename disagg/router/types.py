"""Plain data the routing policy reads and returns.

Everything here crosses a process boundary (Serve replica stats -> router,
router -> proxy) or a layer boundary (simulator -> router), so each message
is a slotted dataclass with a comment on every field and a repr that never
prints prompt contents (block digests are summarized by count).

Tiers are ordered fastest to slowest; a resume that reads any block from tier
``t`` is as slow as ``t``:

    TIERS = ("device", "host", "disk", "remote")     index 0 .. 3

A P/D decode worker reports the requests on their way to its batch
(``inbound_decode_*``) apart from those decoding: a request's decode worker
is chosen before its prefill runs in the pool, so between the two a report
of the running batch alone shows a worker that is about to receive decodes as
idle, and every placement in that window piles onto it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TIERS: tuple[str, ...] = ("device", "host", "disk", "remote")
TIER_INDEX: dict[str, int] = {name: i for i, name in enumerate(TIERS)}
ROLES: tuple[str, ...] = ("prefill", "decode", "both")


@dataclass(slots=True)
class WorkerState:
    """A live snapshot of one engine replica, as reported by the replica."""

    worker_id: str  # stable replica id
    role: str = "both"  # "prefill" | "decode" | "both" (aggregated)
    node_id: str = ""  # host machine; workers of a node share host/disk tiers
    queued_prefill_tokens: int = 0  # prompt tokens waiting for or in prefill
    queued_prefill_requests: int = 0  # requests waiting for or in prefill
    running_decode_tokens: int = 0  # sum of context lengths of running decodes
    running_decode_requests: int = 0  # decode batch size
    inbound_decode_requests: int = 0  # P/D decode worker: requests it took whose prefill runs in the pool
    #                                   or whose hand-off is still arriving: they join its batch next
    inbound_decode_tokens: int = 0  # their prompt tokens
    cache_utilization: float = 0.0  # device KV cache fill, 0..1
    device_tokens: int = 0  # device KV capacity in tokens (0: not reported)
    healthy: bool = True  # passes health checks
    updated_at: float = 0.0  # time the stats were taken (router clock)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown worker role {self.role!r}")
        if not self.node_id:
            self.node_id = self.worker_id
        assert 0.0 <= self.cache_utilization <= 1.0 + 1e-9, "cache_utilization out of [0, 1]"

    @property
    def queue_length(self) -> int:
        """Requests in the replica (what Ray Serve calls queue length: a decode replica holds its
        inbound requests while their prefill runs in the pool)."""
        return self.queued_prefill_requests + self.running_decode_requests + self.inbound_decode_requests


@dataclass(frozen=True, slots=True)
class TailProbe:
    """An unaligned resume point the caller can name (see kv_transfer.keys)."""

    position: int  # resume position p, p % block_size != 0
    digest: bytes  # tail(p) = H("tail" | h_{p // bs} | tokens[..p])

    def __repr__(self) -> str:
        return f"TailProbe(position={self.position})"


@dataclass(slots=True)
class RouteRequest:
    """What the router knows of a request: digests, never tokens or text."""

    request_id: str  # unique per request
    session_id: str = ""  # conversation / agent session ("" = none)
    block_hashes: list[bytes] = field(default_factory=list)  # h_1..h_n of full blocks
    prompt_len: int = 0  # prompt tokens
    block_size: int = 256  # tokens per block
    tail_probes: list[TailProbe] = field(default_factory=list)  # unaligned resume points
    cache_salt: str = ""  # tenant salt (already folded into the digests)
    output_len_hint: int = 0  # expected output tokens, when the client knows them (0 = unknown)
    max_output_tokens: int = 0  # the client's cap (the API's max_tokens; 0 = none): bounds the expectation
    session_end: bool = False  # the session's last turn (the API's session_end): forgotten once it finishes
    text: str | None = None  # optional prompt text (text-radix baseline only)

    def __post_init__(self) -> None:
        assert self.block_size > 0, "block_size must be positive"
        assert len(self.block_hashes) * self.block_size <= max(self.prompt_len, 0) + self.block_size, (
            "more full blocks than the prompt holds"
        )

    def __repr__(self) -> str:
        return (
            f"RouteRequest(request_id={self.request_id!r}, session_id={self.session_id!r}, "
            f"prompt_len={self.prompt_len}, blocks={len(self.block_hashes)}, "
            f"tails={len(self.tail_probes)}, salted={bool(self.cache_salt)})"
        )


@dataclass(slots=True)
class RouteDecision:
    """Where a request goes and why."""

    request_id: str  # the routed request
    decode_worker: str  # worker that streams tokens (or the only worker)
    prefill_worker: str | None = None  # None = prefill locally on decode_worker
    reason: str = ""  # short tag: "disagg", "local_short_suffix", "fallback", ...
    predicted_cached_tokens: int = 0  # resumable tokens where prefill runs
    source_tier: str | None = None  # slowest tier the resume reads (None = no hit)
    scores: dict[str, float] = field(default_factory=dict)  # total score per worker
    state_node: str = ""  # another node whose shared tiers hold more of the prompt (a moved session's last node)
    state_position: int = 0  # ... resumable tokens there (0: none named; disagg.router.router step 4)
    checkpoint_back: tuple[int, ...] | None = None  # tokens back from the prompt's last full block where its
    # prefill keeps checkpoints, learned from every session's follow-ups (disagg.router.divergence); None: the worker's own
    first_turn: bool = False  # the router knew no earlier turn of the request's session, or it names none
    # (the P/D decider's "local_burst")

    @property
    def prefill_target(self) -> str:
        """The worker that runs the prompt's prefill."""
        return self.prefill_worker if self.prefill_worker is not None else self.decode_worker

    def __repr__(self) -> str:
        return (
            f"RouteDecision(request_id={self.request_id!r}, prefill={self.prefill_worker!r}, "
            f"decode={self.decode_worker!r}, reason={self.reason!r}, "
            f"cached={self.predicted_cached_tokens}, tier={self.source_tier!r})"
        )
