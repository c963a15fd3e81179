"""Messages that cross process boundaries (ingress <-> prefill/decode replicas).

Only small control data travels through Ray: state moves through kv_transfer
tiers and is named here by a handle. Reprs keep prompts out of logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.engine.protocol import SamplingParams, TokenLogprob


@dataclass(slots=True)
class PrefillHandle:
    """Where a prefill left the request's state (returned by a prefill replica)."""

    position: int  # tokens whose state was published (== prompt length)
    first_token: int  # the token sampled at the end of the prompt
    num_cached_tokens: int  # prompt tokens the prefill replica reused
    cached_source: str  # where those came from: device | host | disk | peer | computed
    replica_id: str  # the prefill replica (for logs and metrics)
    node_id: str  # node whose host tier holds the state
    published_bytes: int = 0  # bytes written to the host tier for this request
    publish_seconds: float = 0.0  # export + put time
    prefill_seconds: float = 0.0  # compute time on the prefill replica
    device_state: Any = None  # a ``device_ipc.SharedState`` when the state stayed on the prefill's GPU
    checkpoints: tuple[int, ...] = ()  # positions whose state the prefill published (decode's reuse ledger)
    resume_failure: str = ""  # "load_deadline" | "load_failed": what the prefill's own state lookup hit
    first_logprob: TokenLogprob | None = None  # ``first_token``'s, when the request asked for logprobs
    # wall time (the prefill replica's clock) its engine finished the prompt: the pool's load reports taken
    # later no longer count the request (disagg.router.loads NOTE 6); 0: unknown
    computed_at: float = 0.0


@dataclass(slots=True, repr=False)
class GenerateParams:
    """One generation as the ingress hands it to a replica."""

    request_id: str  # unique id (also the engine request id)
    prompt_token_ids: list[int]  # full prompt, tenant-independent token ids
    sampling: SamplingParams  # how to pick tokens
    session_id: str | None = None  # conversation id for affinity (optional)
    session_end: bool = False  # the session's last turn: its state goes first once answered (disagg.flow NOTE 13)
    cache_salt: str = ""  # tenant salt entering every state key
    prefill: PrefillHandle | None = None  # set when a prefill replica ran first
    route_reason: str = ""  # why the router placed it here (metrics)
    resumed_output_tokens: int = 0  # trailing prompt tokens that are this request's own earlier output
    checkpoint_at: tuple[int, ...] = ()  # extra KDA checkpoints the prefill keeps (disagg.reuse.placement)
    checkpoint_back: tuple[int, ...] | None = None  # the router's learned divergences, tokens back from the
    # prompt's last full block (disagg.router.divergence); None: the decode worker's placement uses its own
    ack: bool = False  # the decode replica first sends an empty chunk as it takes the call (disagg.stream_resume)
    state_node: str = ""  # a node whose shared tiers hold a resumable prefix of the prompt (disagg.flow NOTE 10)
    state_position: int = 0  # ... that prefix's length in tokens (0: none named)
    decode_node: str = ""  # the node of the decode replica a prefill hands off to (disagg/workers/tiered.py NOTE 3)
    first_turn: bool = False  # the router knew no earlier turn of its session (the P/D decider's "local_burst")

    def __repr__(self) -> str:
        return (
            f"GenerateParams(id={self.request_id!r}, prompt_len={len(self.prompt_token_ids)}, "
            f"session={self.session_id!r}, prefill={self.prefill})"
        )


@dataclass(slots=True)
class SessionEnd:
    """A tenant's session is over (the API's ``DELETE /v1/sessions/{id}``, ``disagg.flow`` NOTE 14),
    sent to one decode replica (``replica``: the Serve router's id of it; "" any)."""

    session_id: str  # the client's session id
    cache_salt: str = ""  # the tenant's salt (the session's key, ``disagg.session``)
    replica: str = ""  # the decode replica to tell ("": whichever the router picks)


@dataclass(frozen=True, slots=True)
class ToReplica:
    """A call meant for one replica (the ingress's stats, one call each): the Serve routers send it
    to ``replica`` (their id of it), or to any replica when it is not among their candidates ("":
    none named, or gone)."""

    replica: str = ""


@dataclass(slots=True)
class StreamChunk:
    """A piece of a streamed generation (replica -> ingress)."""

    token_ids: list[int] = field(default_factory=list)  # new tokens in order
    finished: bool = False  # last chunk of the request
    finish_reason: str | None = None  # length | stop | abort | error
    num_prompt_tokens: int = 0  # prompt length
    num_cached_tokens: int = 0  # prompt tokens whose state was reused
    cached_source: str = "computed"  # device | host | disk | peer | computed
    error: str | None = None  # message when finish_reason == "error"
    transfer_bytes: int = 0  # state bytes loaded for this request
    transfer_seconds: float = 0.0  # time spent loading them
    replica_id: str = ""  # the replica that produced the chunk
    reuse_misses: dict[str, int] | None = None  # last chunk: prompt tokens missed by reason (disagg.reuse.misses)
    reuse_bound: int = 0  # last chunk: prompt tokens an infinite cache would have reused (the server's view)
    # last chunk: wall times on the replica's clock from which its engine counted the request as a decode and
    # of its end: the routers stop counting it in that replica's load reports taken before its end
    # (disagg.router.loads NOTE 6)
    served: tuple[float, float] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in ``token_ids``, when the request asked
