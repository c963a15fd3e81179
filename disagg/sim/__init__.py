"""Discrete-event simulator of a disaggregated cluster, running the real router code."""

from disagg.sim.cost_model import CostModel, cost_profile
from disagg.sim.simulator import ClusterConfig, SimResult, Simulator
from disagg.sim.workload import (
    SimRequest,
    SynthConfig,
    from_mooncake_records,
    load_mooncake_jsonl,
    synth_sessions,
)

__all__ = [
    "ClusterConfig",
    "CostModel",
    "SimRequest",
    "SimResult",
    "Simulator",
    "SynthConfig",
    "cost_profile",
    "from_mooncake_records",
    "load_mooncake_jsonl",
    "synth_sessions",
]
