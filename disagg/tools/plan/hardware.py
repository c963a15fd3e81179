"""Accelerator presets for capacity planning (vendor-published peak figures).

Compute figures are dense peaks (no sparsity); what a kernel reaches is a
fraction of them (the planner's ``mfu`` / ``mbu``). The host link is the
measured PCIe Gen5 x16 figure of docs/perf (55 GB/s each way on an H200),
used for every preset. Host memory per node is not a property of the
accelerator: ``host_gb`` is a typical 8-GPU server's DRAM, an assumption to
override with ``--host-gb``. Prices come from ``disagg.tools.bench.cost``.

    name      HBM GB   HBM TB/s   FP8 TFLOPS   BF16 TFLOPS
    mi355x      288       8.0        5000         2500
    mi325x      256       6.0        2615         1307
    mi300x      192       5.3        2615         1307
    b300        288       8.0        4500         2250
    b200        180       8.0        4500         2250
    h200        141       4.8        1979          989
    h100         80       3.35       1979          989
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    name: str
    hbm_gb: float  # device memory (GB, 1e9 bytes)
    hbm_tbps: float  # device memory bandwidth (TB/s)
    fp8_tflops: float  # dense peak
    bf16_tflops: float  # dense peak
    gpus_per_node: int = 8
    host_link_gbps: float = 55.0  # host <-> device, each way (GB/s)
    host_gb: float = 2048.0  # host DRAM per node (assumption, see module docstring)
    price_preset: str | None = None  # name in disagg.tools.bench.cost

    def __post_init__(self) -> None:
        if min(self.hbm_gb, self.hbm_tbps, self.fp8_tflops, self.bf16_tflops, self.host_link_gbps) <= 0:
            raise ValueError(f"{self.name}: hardware figures must be positive")
        if self.gpus_per_node < 1:
            raise ValueError(f"{self.name}: gpus_per_node must be >= 1")


PRESETS: dict[str, HardwareSpec] = {
    "mi355x": HardwareSpec("mi355x", 288, 8.0, 5000, 2500, price_preset="mi355x"),
    "mi325x": HardwareSpec("mi325x", 256, 6.0, 2615, 1307, price_preset="mi325x"),
    "mi300x": HardwareSpec("mi300x", 192, 5.3, 2615, 1307, price_preset="mi300x"),
    "b300": HardwareSpec("b300", 288, 8.0, 4500, 2250, price_preset="b300"),
    "b200": HardwareSpec("b200", 180, 8.0, 4500, 2250, price_preset="b200"),
    "h200": HardwareSpec("h200", 141, 4.8, 1979, 989, price_preset="h200"),
    "h100": HardwareSpec("h100", 80, 3.35, 1979, 989, price_preset="h100"),
}


def load_hardware(name: str) -> HardwareSpec:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]
