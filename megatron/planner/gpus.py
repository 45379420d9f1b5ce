"""Accelerator presets for ``--gpu-type``: memory, dense 16-bit peak, HBM and link bandwidths (vendor data sheets).

Inter-node bandwidth is the per-GPU share of the node's network cards for the usual build (one 200 Gb/s HDR card
per A100, one 400 Gb/s NDR card per H100/H200); pass ``--inter-node-GBps`` for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.neox_arguments.errors import ConfigError


@dataclass(frozen=True)
class GpuType:
    """One accelerator model."""

    name: str
    memory_bytes: int
    peak_tflops: float  # dense fp16/bf16 tensor-core peak
    hbm_GBps: float
    intra_node_GBps: float  # NVLink, per direction
    inter_node_GBps: float


GPU_TYPES: dict[str, GpuType] = {
    g.name.lower(): g
    for g in (
        GpuType("A100-40GB", 40 * 10**9, 312.0, 1555.0, 300.0, 25.0),
        GpuType("A100-80GB", 80 * 10**9, 312.0, 2039.0, 300.0, 25.0),
        GpuType("H100-80GB", 80 * 10**9, 989.0, 3350.0, 450.0, 50.0),
        GpuType("H200-141GB", 141 * 10**9, 989.0, 4800.0, 450.0, 50.0),
    )
}


def gpu_type(name: str) -> GpuType:
    """The preset called ``name`` (case-insensitive); ConfigError listing the valid names otherwise."""
    try:
        return GPU_TYPES[name.lower()]
    except KeyError:
        valid = ", ".join(g.name for g in GPU_TYPES.values())
        raise ConfigError(f"--gpu-type {name!r}: unknown; valid: {valid}") from None
