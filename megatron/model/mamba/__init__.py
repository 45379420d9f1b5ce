"""Mamba (v1) residual layers: GPT-NeoX's ``attention_config`` type ``mamba``."""

from megatron.model.mamba.block import (
    MambaState,
    ParallelMambaBlock,
    ParallelMambaResidualLayer,
    ParallelMambaResidualLayerPipe,
)
from megatron.model.mamba.scan import selective_scan, selective_state_step
from megatron.model.mamba.sizes import mamba_dt_rank, mamba_inner_size

__all__ = [
    "MambaState",
    "ParallelMambaBlock",
    "ParallelMambaResidualLayer",
    "ParallelMambaResidualLayerPipe",
    "mamba_dt_rank",
    "mamba_inner_size",
    "selective_scan",
    "selective_state_step",
]
