"""The one table of routing plugins, and profile construction from config.

A profile config names plugins from ``PLUGINS``; a plugin is written either
as its name or as ``{name: {param: value}}``; a scorer's value is its weight
or ``{weight: w, params: {...}}``. Shared plugin parameters live under the
top-level ``plugins`` key and apply to every instance of that plugin::

    profiles:
      both:
        filters: [healthy, role, load_guard]
        scorers: {prefix: 2, load: 1, affinity: 0.5}
        picker: {max_score: {epsilon: 0.0}}
    plugins:
      prefix: {tier_weights: {device: 1.0, host: 0.85, disk: 0.5, remote: 0.4}}
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from disagg.router.filters.healthy import HealthyFilter
from disagg.router.filters.load_guard import LoadGuardFilter
from disagg.router.filters.role import RoleFilter
from disagg.router.picker import MaxScorePicker
from disagg.router.profile import SchedulingProfile
from disagg.router.scorers.affinity import AffinityScorer
from disagg.router.scorers.decode import DecodeScorer
from disagg.router.scorers.load import LoadScorer
from disagg.router.scorers.prefix import PrefixScorer
from disagg.router.scorers.wait import WaitScorer

FILTERS: dict[str, Callable[..., Any]] = {
    "healthy": HealthyFilter,
    "role": RoleFilter,
    "load_guard": LoadGuardFilter,
}
SCORERS: dict[str, Callable[..., Any]] = {
    "prefix": PrefixScorer,
    "load": LoadScorer,
    "affinity": AffinityScorer,
    "wait": WaitScorer,
    "decode": DecodeScorer,
}
PICKERS: dict[str, Callable[..., Any]] = {"max_score": MaxScorePicker}
PLUGINS: dict[str, dict[str, Callable[..., Any]]] = {
    "filters": FILTERS,
    "scorers": SCORERS,
    "pickers": PICKERS,
}

# Aggregated and prefill placement: cache first (prefix), then how long the request would
# wait relative to its own compute (wait), then the time-averaged queue that separates idle
# workers (load), then the session's previous worker (affinity); see docs/router.md.
BALANCE_LOAD: dict[str, Any] = {
    "weight": 1.0,
    "params": {"prefill_weight": 0.0, "decode_weight": 0.25, "cache_weight": 0.0, "session_weight": 0.0,
               "queue_avg_weight": 1.0},
}
# Aggregated placement also counts the decodes running on a worker as sequences (the load scorer's
# requests term, weight 0.5: each slows every step whatever its context), for prompts up to an eighth
# of the candidates' devices. Past that, moving a context off the worker that holds it for a count of
# co-runners leaves a second copy on a device and pushes other sessions' state out: unbounded, the
# term slowed the held-out long documents' TTFT P90 on every seed tried. Bounded, cells that meet every
# figure: Mooncake family 16 workers 38 -> 41 of 48 (seeds 25-36, never tuned on: 18 -> 19 of 24),
# 64 workers 13 -> 18 of 24; the held-out sets and the suite keep theirs (docs/router.md, "Round 29").
AGGREGATED_LOAD: dict[str, Any] = {
    "weight": 1.0,
    "params": {**BALANCE_LOAD["params"], "requests_weight": 0.5, "requests_max_prompt_share": 0.125},
}
# Aggregated placement also prices the decode time a placement costs (decode, in seconds, see
# disagg.router.scorers.decode); a node mate reads a session's state from the shared host tier
# (the prefix scorer already charges the read's time), so its host credit is close to a device
# hit's and affinity only breaks ties: a session moves within its node when decode time says so.
# The decode weight: 6 was the middle of a plateau under round 7's periodic checkpoints (5, 6 and 7
# met every aggregated cell's P90 interactivity and tok/s/GPU; 3 and 4 trailed the Dynamo-style
# baseline on long_agentic/16 and agentx/16). With serving's checkpoint placement and the router's
# learned divergences a session resumes more of its prompt, and 6 tied that baseline's P90
# interactivity on agentx/16 (x0.9999) on every seed; 10 meets it in 35 of the 36 aggregated
# cell-seeds (docs/router.md, "Round 11"). At 10, a held-out shape at 64 workers (docqa) still sent
# 90 of 1,256 turns to their own busy worker while a node mate sat idle: the time-averaged prefill
# queue (load) favoured the busy one by more than the decode term charged for the shared batch.
# At 14 such turns fall to 26, the P90 band decodes alone, and the suite keeps 35 of 36 ("Round 12").
# Weight 28, with the decode time r adds to the decodes it joins (count_joined): on traces of
# Mooncake's format with few sessions a worker (16 workers, open loop), 14 without it still put
# turns on workers where another session decoded (on one, 1.4 requests shared a worker with each
# request at or past the P90 ITL, 0.16 under the Dynamo-style baseline: x0.979). Over the suite's
# aggregated cells (three seeds), 24 Mooncake-family traces at 16 workers, 12 at 64 and the
# held-out set: 87 of 121 cells at 14, 92 at 28, 96 at 28 with count_joined (88 at 14 with it).
# Past 28 (34) long documents move across nodes and recompute (held-out longdoc loses TTFT P90 and
# P90 interactivity; docs/router.md, "Round 25"). A serving test failure once blamed on it came
# from replica reports that still counted a turn after it ended, under the P/D decode profile too
# (disagg.router.loads NOTE 6; docs/router.md, "Round 26").
AGGREGATED_PREFIX: dict[str, Any] = {
    "weight": 2.0,
    "params": {"tier_weights": {"device": 1.0, "host": 0.95, "disk": 0.5, "remote": 0.4}},
}
DEFAULT_PROFILES: dict[str, dict[str, Any]] = {
    "both": {
        "filters": ["healthy", "role", "load_guard"],
        "scorers": {"prefix": AGGREGATED_PREFIX, "wait": 1.5, "load": AGGREGATED_LOAD,
                    "decode": {"weight": 28.0, "params": {"count_joined": True}},
                    "affinity": 0.1},
    },
    "prefill": {
        "filters": ["healthy", {"role": {"phase": "prefill"}}, "load_guard"],
        "scorers": {"prefix": 2.0, "wait": 1.5, "load": BALANCE_LOAD, "affinity": 0.5},
    },
    # P/D decode placement: running decodes (load, weight 8) spread the decode batches a request
    # joins; 8, not 1: one more sequence in the batch is most of what separated the P/D cells' P90
    # ITL from the best baseline's once local prefills stopped stalling them (docs/router.md, "Round 7").
    # Its decode tokens are scaled by the busiest worker's, or 64K tokens when all carry less: a decode
    # pool's workers carry a few sessions of 10-60K tokens each, and the load scorer's floor of 256K
    # left differences of a session or two too small to weigh against the state a worker holds; with
    # the router learning outputs rather than told them, 64K raises P/D P90 interactivity in 31 of the
    # suite's 36 P/D cells over three seeds and 22 of 24 Mooncake-family cells ("Round 24").
    # The decodes running and on their way count as sequences too (requests, weight 2 in the load
    # scorer), each slowing every step whatever its context: P90 interactivity rises in 20 of 24
    # Mooncake-family P/D cells (7 -> 17 meet every figure), 21 of 24 on twelve traces not tuned on
    # (9 -> 15) and 25 of 36 suite P/D cells (15 -> 14: hit/bound at 0.95 in two 16-worker cells);
    # held-out P/D 3 -> 5 of 13 ("Round 28")
    "decode": {
        "filters": ["healthy", {"role": {"phase": "decode"}}],
        "scorers": {
            "prefix": 1.0,
            "load": {"weight": 8.0, "params": {"prefill_weight": 0.3, "decode_weight": 1.0,
                                               "requests_weight": 2.0, "decode_floor_tokens": 65536}},
            "affinity": 0.5,
            "decode": 3.0,
        },
    },
}


def _split(spec: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict) and len(spec) == 1:
        name, params = next(iter(spec.items()))
        return name, dict(params or {})
    raise ValueError(f"plugin spec must be a name or {{name: params}}, got {spec!r}")


def _make(table: dict[str, Callable[..., Any]], name: str, params: dict[str, Any]) -> Any:
    if name not in table:
        raise ValueError(f"unknown plugin {name!r}; known: {sorted(table)}")
    return table[name](**params)


def build_profile(
    name: str, cfg: dict[str, Any], shared: dict[str, dict[str, Any]] | None = None
) -> SchedulingProfile:
    """Build one profile from its config dict (see module docstring)."""
    shared = shared or {}
    unknown = set(cfg) - {"filters", "scorers", "picker"}
    if unknown:
        raise ValueError(f"profile {name!r}: unknown keys {sorted(unknown)}")
    filters = []
    for spec in cfg.get("filters", []):
        fname, params = _split(spec)
        filters.append(_make(FILTERS, fname, {**shared.get(fname, {}), **params}))
    scorers = []
    for sname, val in cfg.get("scorers", {}).items():
        if isinstance(val, dict):
            weight = float(val.get("weight", 1.0))
            params = dict(val.get("params", {}))
        else:
            weight, params = float(val), {}
        scorers.append((_make(SCORERS, sname, {**shared.get(sname, {}), **params}), weight))
    pname, pparams = _split(cfg.get("picker", "max_score"))
    picker = _make(PICKERS, pname, {**shared.get(pname, {}), **pparams})
    return SchedulingProfile(name, filters, scorers, picker)


def build_profiles(
    profiles: dict[str, dict[str, Any]] | None = None, shared: dict[str, dict[str, Any]] | None = None
) -> dict[str, SchedulingProfile]:
    """Defaults overlaid by ``profiles`` (a profile given replaces the default)."""
    merged = copy.deepcopy(DEFAULT_PROFILES)
    merged.update(copy.deepcopy(profiles or {}))
    return {name: build_profile(name, cfg, shared) for name, cfg in merged.items()}
