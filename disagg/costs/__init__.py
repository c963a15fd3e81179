"""What an engine's work costs in time: the cost model and the engine profiles it is fitted from.

Core, not a tool: the simulator runs its engines on it (``disagg.tools.sim``), the planner
writes roofline profiles for it (``disagg.tools.plan``), and the router prices time with it,
in the simulator and in serving (``disagg.router.calibration``, ``router.engine_profile``).

``model`` (``CostModel``, the named cost models ``small`` and ``large``) <- ``profile``
(measured points, their provenance and the fit; the named profiles in ``profiles/``).
"""

from disagg.costs.model import PROFILES, CostModel
from disagg.costs.profile import EngineProfile, cost_profile, load_profile, profile_names

__all__ = ["PROFILES", "CostModel", "EngineProfile", "cost_profile", "load_profile", "profile_names"]
