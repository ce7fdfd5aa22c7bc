"""Accelerator figures the tools divide by, per chip, with where each number comes from.

A v7x chip is two JAX devices (two chiplets, each with its own HBM); memory budgets are per
device, bandwidth and FLOPS per chip. Sources: the K3 feasibility report §5 (tops/hardware.py
figures; the v7x HBM bandwidth agrees with the public Ironwood spec), §12.1 ⑨ and §12.3 (usable
HBM measured on v7x-16: 94.74 GiB per device).
"""

from __future__ import annotations

import dataclasses

from k3text.tools.tables import GiB


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bandwidth: float  # bytes/s per chip
    bf16_flops: float  # dense peak per chip
    fp8_flops: float
    devices_per_chip: int  # JAX devices a chip exposes
    hbm_per_device: float  # bytes a JAX device can allocate
    hbm_note: str  # where hbm_per_device comes from


HARDWARE: dict[str, Hardware] = {
    "v7x": Hardware("v7x", 7.38e12, 2307e12, 4614e12, 2, 94.74 * GiB,
                    "usable, measured on v7x-16"),
    # v6e has no fp8 matmul rate of its own: fp8 runs at the bf16 rate.
    "v6e": Hardware("v6e", 1.638e12, 918e12, 918e12, 1, 32 * GiB,
                    "nominal, not measured"),
}


def hardware_rows() -> list[list[str]]:
    """The table above as printable rows (per chip unless marked per device)."""
    return [[h.name, f"{h.hbm_bandwidth / 1e12:.4g} TB/s", f"{h.bf16_flops / 1e12:,.0f}",
             f"{h.fp8_flops / 1e12:,.0f}", str(h.devices_per_chip),
             f"{h.hbm_per_device / GiB:.2f} GiB ({h.hbm_note})"] for h in HARDWARE.values()]


HARDWARE_HEADERS = ("chip", "HBM bandwidth", "bf16 TFLOPS", "fp8 TFLOPS", "devices",
                    "HBM per device")
