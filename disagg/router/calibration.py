"""The router's time constants, taken from the engine it routes for.

The state-aware router prices placements in seconds: the compute a cache hit
saves and the transfer it costs (prefix scorer), the wait ahead of a prefill
relative to its own compute (wait scorer), the decode steps a request runs and
slows, and the stall a prefill puts into a running batch (decode scorer).
Each scorer has built-in constants, and they are the simulator's ``small``
cost model: one H200 serving a small hybrid model (25K prefill tokens/s,
8 ms decode steps, 4.6 KB of MLA state a token, 16 MB KDA checkpoints).
An engine that is not that one needs its own:

| engine (``disagg/costs/profiles``) | prefill tokens/s | prefill step | decode step, batch 1 -> 16 | state a token | checkpoint |
|---|---|---|---|---|---|
| built in (``small``) | 25,000 | 4 ms | 8.1 -> 9.6 ms | 4.6 KB | 16 MB |
| ``h200-small`` (measured) | 26,282 | 222 ms | 56 -> 214 ms | 4.6 KB | 16 MB |
| ``mi355x-k3`` (roofline, TP 8) | 343,541 | 26 ms | 11 -> 17 ms | 13.8 KB | 150 MB |

With the built-in constants on ``h200-small`` the decode scorer prices one
more sequence in a batch at 0.1 ms where it costs 10.6 ms, and the router
packed decodes the engine cannot afford to pack (P90 interactivity 0.74 of
the best baseline's on two Mooncake-format traces, docs/router.md
"Round 33"). ``engine_router_config`` maps an engine's cost model to the
router's shared plugin parameters::

    prefix.prefill_tokens_per_s   0.8 * engine rate       the ratio the built-in 20K was tuned at
    prefix.bytes_per_token, checkpoint_bytes, bandwidth_gbps, latency_s     the engine's state and links
    decode.*                      the engine's decode step (its batch curve when measured), prefill
                                  rate, state sizes and host / remote links
    pending_step_tokens           the engine's prefill budget a step

The decider's token thresholds and the load scorer's token scales are not
time constants and stay as configured. The wait scorer keeps its own figures. Its score is the request's own
compute over that plus the queue ahead, in which the rate cancels; what an
engine's rate changes is only where the floor (one short prefill step)
binds. Calibrated, on the MI355X roofline (343K tokens/s, 26 ms steps)
every prompt under ~9K tokens counted as that long and a queue weighed
less: with the wait scorer's built-in figures, cells that meet every figure
rose on all three engine families measured (docs/router.md, "Round 33").

Rates are rounded to 6 significant figures (no profile knows them better), so
the built-in engine maps to exactly the built-in constants and a run on it
places as before. What a caller sets in its own router config wins over the
engine's figures (``with_engine_costs``). In the simulator the state-aware
router is calibrated to the run's cost model (``disagg sim run --profile``;
``--router-costs builtin`` turns it off). Serving's routers are calibrated to
the profile ``router.engine_profile`` names (``disagg.costs``; the Serve
adapter calls ``with_engine_costs`` as the simulator does) and keep the
built-in constants when it is unset.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

PREFIX_RATE_SHARE = 0.8  # the prefix scorer's rate over the engine's (20K against 25K when tuned)


def _sig(x: float, digits: int = 6) -> float:
    """``x`` to ``digits`` significant figures (1 / 4e-5 is 24999.999999999996, not 25000)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def engine_router_config(cost: Mapping[str, Any]) -> dict[str, Any]:
    """The router config (``RouterConfig`` keys: ``plugins``, ``pending_step_tokens``) that prices
    time as the engine of ``cost`` runs; ``cost``: a cost model's fields
    (``disagg.costs.model.CostModel.to_dict()``)."""
    per_token = float(cost["prefill_per_token_s"])
    if per_token <= 0:
        raise ValueError("the engine's prefill_per_token_s must be positive")
    rate = _sig(1.0 / per_token)
    bw = {k: float(v) for k, v in cost["bandwidth_gbps"].items()}
    lat = {k: float(v) for k, v in cost["latency_s"].items()}
    for tier in ("host", "remote"):
        if tier not in bw or tier not in lat:
            raise ValueError(f"the engine's cost model has no {tier} link")
    decode: dict[str, Any] = {
        "decode_base_s": float(cost["decode_base_s"]), "decode_per_seq_s": float(cost["decode_per_seq_s"]),
        "decode_per_ctx_token_s": float(cost["decode_per_ctx_token_s"]), "prefill_tokens_per_s": rate,
        "bytes_per_token": float(cost["bytes_per_token"]), "checkpoint_bytes": float(cost["checkpoint_bytes"]),
        "host_gbps": bw["host"], "remote_gbps": bw["remote"],
        "host_latency_s": lat["host"], "remote_latency_s": lat["remote"],
    }
    curve = cost.get("decode_batch_curve")
    if curve:
        decode["batch_curve"] = [[int(b), float(g)] for b, g in curve]
    return {
        "plugins": {
            "prefix": {"bytes_per_token": float(cost["bytes_per_token"]),
                       "checkpoint_bytes": float(cost["checkpoint_bytes"]),
                       "bandwidth_gbps": bw, "latency_s": lat,
                       "prefill_tokens_per_s": _sig(PREFIX_RATE_SHARE * rate)},
            "decode": decode,
        },
        "pending_step_tokens": int(cost["max_prefill_tokens_per_step"]),
    }


def with_engine_costs(config: Mapping[str, Any] | None, cost: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a router config dict, or None) over the engine's figures: a plugin parameter or
    ``pending_step_tokens`` that ``config`` sets keeps its value; ``config`` is not modified."""
    out = copy.deepcopy(dict(config or {}))
    eng = engine_router_config(cost)
    plugins = out.setdefault("plugins", {})
    for name, params in eng["plugins"].items():
        plugins[name] = {**params, **(plugins.get(name) or {})}
    out.setdefault("pending_step_tokens", eng["pending_step_tokens"])
    return out
