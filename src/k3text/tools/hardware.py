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


@dataclasses.dataclass(frozen=True)
class CallLatency:
    """A per-call latency band for one collective kind, in seconds, and what it rests on."""

    low: float
    high: float
    basis: str


# Small-message collectives on v7x-16, from the K3 report §12.1 ⑩: all-to-all measured at
# 9.88 us per call chained (each call waits for the last) and 2.35 us when ~1,000 independent
# calls overlap, flat from 64 B to 16 KB; a synthetic psum on a 1-D 32-device mesh at
# 16.3-18.8 us chained (no overlapped figure). None of them is a measurement of k3text's own
# program: they price a compiled collective count, they do not predict it.
V7X16_CALL_LATENCY: dict[str, CallLatency] = {
    "all-to-all": CallLatency(2.35e-6, 9.88e-6, "measured a2a, overlapped .. chained"),
    "ragged-all-to-all": CallLatency(2.35e-6, 9.88e-6, "priced as the measured a2a"),
    "all-reduce": CallLatency(16.3e-6, 18.8e-6, "synthetic chained psum"),
    "reduce-scatter": CallLatency(16.3e-6, 18.8e-6, "unmeasured: priced as the psum"),
    "all-gather": CallLatency(2.35e-6, 18.8e-6, "unmeasured: a2a overlapped .. psum chained"),
    "collective-permute": CallLatency(2.35e-6, 18.8e-6, "unmeasured: a2a overlapped .. psum"),
    "collective-broadcast": CallLatency(2.35e-6, 18.8e-6, "unmeasured: a2a overlapped .. psum"),
}


HARDWARE_HEADERS = ("chip", "HBM bandwidth", "bf16 TFLOPS", "fp8 TFLOPS", "devices",
                    "HBM per device")
