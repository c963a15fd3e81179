"""Baseline routers behind the same interface as ``StateAwareRouter``.

``BASELINES`` is the one table the simulator and benchmarks build them from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disagg.router.baselines.dynamo_cost import DynamoCostRouter
from disagg.router.baselines.power_of_two import PowerOfTwoRouter
from disagg.router.baselines.prefix_affinity import PrefixAffinityRouter
from disagg.router.baselines.round_robin import RoundRobinRouter
from disagg.router.index import PrefixIndex

BASELINES: dict[str, Callable[[PrefixIndex, int], Any]] = {
    "round_robin": lambda index, seed: RoundRobinRouter(),
    "power_of_two": lambda index, seed: PowerOfTwoRouter(seed=seed),
    "prefix_affinity": lambda index, seed: PrefixAffinityRouter(seed=seed),
    "dynamo_cost": lambda index, seed: DynamoCostRouter(index),
}

__all__ = ["BASELINES", "DynamoCostRouter", "PowerOfTwoRouter", "PrefixAffinityRouter", "RoundRobinRouter"]
