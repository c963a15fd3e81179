"""Capacity planning: state bytes per token / GPU / tier, resident sessions, draft depth, roofline profiles."""

from disagg.tools.plan.hardware import HardwareSpec, load_hardware
from disagg.tools.plan.memory import PlanConfig, PlanResult, plan
from disagg.tools.plan.models import ModelSpec, from_hf_config, load_model

__all__ = ["HardwareSpec", "ModelSpec", "PlanConfig", "PlanResult", "from_hf_config", "load_hardware",
           "load_model", "plan"]
