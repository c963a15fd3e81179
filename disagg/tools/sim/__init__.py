"""Discrete-event simulator of a disaggregated cluster, running the real router code.

Modules, imports pointing down: ``cli`` -> ``sweep``, ``shard``, ``calibrate`` ->
``simulator`` -> ``driver``, ``worker``, ``state`` -> ``cache``, ``workload``,
``metrics``; the engines' cost model and profiles are the core's ``disagg.costs``. See docs/sim.md.
"""

from disagg.costs.model import CostModel
from disagg.costs.profile import EngineProfile, cost_profile, load_profile, profile_names
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.shard import simulate
from disagg.tools.sim.simulator import ClusterConfig, SimResult, Simulator
from disagg.tools.sim.workload import (
    SimRequest,
    SynthConfig,
    from_mooncake_records,
    from_trace_records,
    load_mooncake_jsonl,
    synth_sessions,
)

__all__ = [
    "ClusterConfig",
    "CostModel",
    "EngineProfile",
    "ReplayConfig",
    "SimRequest",
    "SimResult",
    "Simulator",
    "SynthConfig",
    "cost_profile",
    "from_mooncake_records",
    "from_trace_records",
    "load_mooncake_jsonl",
    "load_profile",
    "profile_names",
    "simulate",
    "synth_sessions",
]
