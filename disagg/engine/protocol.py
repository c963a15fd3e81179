"""The engine protocol: what a prefill or decode server needs from an engine.

Two backends implement it: ``reference`` (the embedded PyTorch K3 model, CPU or
GPU) and ``vllm`` (vLLM's async engine with the kv_transfer connector). Servers
only talk to this protocol, so the same deployments run either.

A request's tokens and what the engine has computed of them:

    token_ids   p0 p1 ... p(n-1) | o0 o1 ... o(k-1)
                <---- prompt ---->  <-- outputs -->
    num_computed: tokens whose state is in the cache. Sampling happens when a
    step computes the last token of token_ids; the sampled token is appended.
    After a turn ends, num_computed == len(token_ids) - 1: the last output has
    not been fed through the model (the next turn's prefill starts there).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kv_transfer.objects import ResumeState, StateLayout


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. Validated at construction (ValueError on bad values)."""

    max_tokens: int = 16  # tokens to generate (>= 1)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # per-request seed; sampling is reproducible given it
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end the request
    ignore_eos: bool = False  # keep going past the model's eos id
    logprobs: int | None = None  # report each sampled token's log probability and this many alternatives

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")


MAX_LOGPROBS = 20  # alternatives per token an engine reports at most


@dataclass(slots=True)
class TokenLogprob:
    """A sampled token's log probability under the model (before temperature and top-p, as vLLM's
    default reports it) and the most likely tokens at its position."""

    logprob: float  # log p(sampled token)
    top: list[tuple[int, float]]  # (token id, log p), most likely first; ``SamplingParams.logprobs`` of them


@dataclass(slots=True, repr=False)
class EngineRequest:
    """One generation request as the engine sees it."""

    request_id: str  # unique among live requests of this engine
    prompt_token_ids: list[int]  # the full prompt (including any resumed prefix)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    resume: ResumeState | None = None  # imported state for prompt[:resume.position]
    keep_state: bool = False  # keep state after finishing until release()
    first_output_index: int = 0  # index of the first token this engine samples (seeded sampling)
    cached_source: str = "host"  # where ``resume`` came from: "host" | "disk" | "peer" | "device"
    cache_salt: str = ""  # tenant salt: device-resident state is only shared within a salt
    checkpoint_at: tuple[int, ...] = ()  # with keep_state: also keep KDA checkpoints here (block boundaries)
    save_state: bool = True  # False: nothing will resume it (a session's last turn): an engine whose
    # connector saves finished state itself (vLLM) saves none of it (disagg.flow NOTE 13)

    def __repr__(self) -> str:  # keep prompts out of logs
        return (
            f"EngineRequest(id={self.request_id!r}, prompt_len={len(self.prompt_token_ids)}, "
            f"resume={self.resume.position if self.resume else None}, sampling={self.sampling})"
        )


@dataclass(slots=True)
class TokenOutput:
    """What one engine step produced for one request."""

    request_id: str  # which request
    new_token_ids: list[int]  # tokens sampled in this step (0 or 1 for the reference engine)
    finished: bool = False  # the request is done
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    num_prompt_tokens: int = 0  # prompt length
    num_cached_tokens: int = 0  # prompt tokens whose state was reused, not computed
    cached_source: str = "computed"  # "device" | "host" | "disk" | "peer" | "computed"
    error: str | None = None  # message when finish_reason == "error"
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them


class Engine(Protocol):
    """Synchronous engine stepped by one thread."""

    model_id: str
    block_size: int
    layout: StateLayout

    def add_request(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[TokenOutput]: ...

    def has_work(self) -> bool: ...

    def export_state(self, request_id: str, position: int | None = None, first_block: int = 0) -> ResumeState: ...

    def release(self, request_id: str, keep_resident: bool = True) -> None: ...


class AsyncEngineProtocol(Protocol):
    """What Serve deployments call (the request flow asks more: ``disagg.flow.FlowEngine``)."""

    model_id: str
    block_size: int

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenOutput]: ...

    async def export_state(self, request_id: str, position: int | None = None, first_block: int = 0) -> ResumeState: ...

    async def release(self, request_id: str, keep_resident: bool = True) -> None: ...
