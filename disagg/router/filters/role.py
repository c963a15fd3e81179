"""Role filter: keep the workers that can run the phase being placed.

    phase "prefill" -> roles {prefill, both}
    phase "decode"  -> roles {decode, both}
    phase "both"    -> every role (aggregated placement)

The phase comes from the context unless fixed in the config.

Config example (YAML)::

    filters: [{role: {phase: prefill}}]
"""

from __future__ import annotations

from disagg.router.context import PHASES, RoutingContext
from disagg.router.types import ROLES, WorkerState

ALLOWED_ROLES = {
    "prefill": ("prefill", "both"),
    "decode": ("decode", "both"),
    "both": ("prefill", "decode", "both"),
}


class RoleFilter:
    name = "role"

    def __init__(self, phase: str | None = None):
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self.phase = phase

    def filter(self, ctx: RoutingContext, workers: list[WorkerState]) -> list[WorkerState]:
        roles = ALLOWED_ROLES[self.phase or ctx.phase]
        if len(roles) == len(ROLES):  # aggregated placement: every role runs it
            return workers
        kept = [w for w in workers if w.role in roles]
        return workers if len(kept) == len(workers) else kept
