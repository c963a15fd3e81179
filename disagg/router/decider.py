"""Prefill/decode decider: disaggregate, or prefill on the decode worker.

    suffix = prompt_len - resumable(decode_worker)       tokens left to compute
    local  if suffix <= local_prefill_max_tokens          ("local_short_suffix")
    local  if min_{p in prefill pool} q_p >= prefill_busy_tokens
           and suffix <= busy_local_max_tokens             ("local_prefill_busy")
    else   disaggregate                                   ("disagg")

A short suffix costs less to compute inside the decode batch than to ship
through a prefill worker (an extra hop and a state transfer); a saturated
prefill pool makes local prefill the faster path for medium suffixes too.

The same decider decides in serving (``disagg.flow``, fed with the prefill
pool's effective loads by the Serve adapter) and in the simulator (through
``StateAwareRouter``). Its defaults are set once, in ``disagg.config``
(``router.local_prefill_max_tokens`` and friends).

Config example (YAML, the router policy's ``decider`` key)::

    decider: {local_prefill_max_tokens: 256, prefill_busy_tokens: 65536,
              busy_local_max_tokens: 8192}
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.config import BUSY_LOCAL_MAX_TOKENS, LOCAL_PREFILL_MAX_TOKENS, PREFILL_BUSY_TOKENS


@dataclass(slots=True)
class DeciderConfig:
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS  # suffixes up to this prefill locally
    prefill_busy_tokens: float = PREFILL_BUSY_TOKENS  # least-loaded prefill queue that counts as busy
    busy_local_max_tokens: int = BUSY_LOCAL_MAX_TOKENS  # local prefill limit while the pool is busy

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens < 0 or self.busy_local_max_tokens < 0:
            raise ValueError("local prefill limits must be >= 0")
        if self.prefill_busy_tokens <= 0:
            raise ValueError("prefill_busy_tokens must be positive")


@dataclass(frozen=True, slots=True)
class PDDecision:
    disaggregate: bool  # True: run prefill on a prefill worker
    reason: str  # "disagg" | "local_short_suffix" | "local_prefill_busy" | "local_no_prefill_pool"


class PDDecider:
    def __init__(self, config: DeciderConfig | None = None, **params: object):
        self.config = config or DeciderConfig(**params)  # type: ignore[arg-type]

    def decide(self, suffix_tokens: int, prefill_loads: list[float]) -> PDDecision:
        """Args: uncached suffix at the decode worker; effective queued prefill per prefill worker."""
        cfg = self.config
        if not prefill_loads:
            return PDDecision(False, "local_no_prefill_pool")
        if suffix_tokens <= cfg.local_prefill_max_tokens:
            return PDDecision(False, "local_short_suffix")
        if min(prefill_loads) >= cfg.prefill_busy_tokens and suffix_tokens <= cfg.busy_local_max_tokens:
            return PDDecision(False, "local_prefill_busy")
        return PDDecision(True, "disagg")
