"""GPU-hour prices and tokens per dollar.

Formulas::

    tokens per dollar       = tokens/s/GPU * 3600 / ($ per GPU-hour)
    $ per million tokens    = 1e6 / tokens per dollar

Presets are the InferenceX cost constants ($ per GPU-hour), by pricing tier:

    GPU      hyperscaler  neocloud  3yr
    H100        1.30        1.69    1.30
    H200        1.41        1.74    1.60
    B200        1.95        2.34    2.90
    B300        2.34        2.81    3.48
    MI300X      1.12        1.40    1.55
    MI325X      1.28        1.59    1.80
    MI355X      1.48        1.90    2.10

A price spec is a number (``"1.50"``), a GPU (``"mi355x"``: hyperscaler tier)
or a GPU and tier (``"mi355x-neocloud"``, ``"b300:3yr"``).
"""

from __future__ import annotations

import re

TIERS: tuple[str, ...] = ("hyperscaler", "neocloud", "3yr")
GPU_HOUR_USD: dict[str, tuple[float, float, float]] = {
    "H100": (1.30, 1.69, 1.30),
    "H200": (1.41, 1.74, 1.60),
    "B200": (1.95, 2.34, 2.90),
    "B300": (2.34, 2.81, 3.48),
    "MI300X": (1.12, 1.40, 1.55),
    "MI325X": (1.28, 1.59, 1.80),
    "MI355X": (1.48, 1.90, 2.10),
}
_TIER_ALIASES = {
    "hyperscaler": "hyperscaler",
    "hs": "hyperscaler",
    "neocloud": "neocloud",
    "neo": "neocloud",
    "3yr": "3yr",
    "3-year": "3yr",
    "3year": "3yr",
}


def preset_names() -> list[str]:
    return [f"{gpu.lower()}-{tier}" for gpu in GPU_HOUR_USD for tier in TIERS]


def gpu_hour_price(spec: str | float) -> float:
    """Resolve a price spec to $ per GPU-hour.

    Raises:
        ValueError: unknown GPU or tier, or a non-positive price.
    """
    if isinstance(spec, (int, float)):
        price = float(spec)
    else:
        text = spec.strip()
        try:
            price = float(text.lstrip("$"))
        except ValueError:
            parts = re.split(r"[-:/ ]", text, maxsplit=1)
            gpu = parts[0].upper()
            tier = _TIER_ALIASES.get(parts[1].lower() if len(parts) > 1 else "hyperscaler")
            if gpu not in GPU_HOUR_USD or tier is None:
                raise ValueError(
                    f"unknown price preset {spec!r}; use a number or one of "
                    f"{', '.join(preset_names())}"
                ) from None
            price = GPU_HOUR_USD[gpu][TIERS.index(tier)]
    if price <= 0:
        raise ValueError(f"price must be > 0, got {price}")
    return price


def tokens_per_dollar(tokens_per_s_per_gpu: float, usd_per_gpu_hour: float) -> float:
    return tokens_per_s_per_gpu * 3600.0 / usd_per_gpu_hour


def usd_per_million_tokens(tokens_per_s_per_gpu: float, usd_per_gpu_hour: float) -> float:
    if tokens_per_s_per_gpu <= 0:
        return float("inf")
    return 1e6 / tokens_per_dollar(tokens_per_s_per_gpu, usd_per_gpu_hour)
