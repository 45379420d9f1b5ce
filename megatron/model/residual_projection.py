"""The row-parallel projection back into the residual stream: attention's ``dense`` and the MLP's ``linear2``."""

from __future__ import annotations

from collections.abc import Callable

from megatron import mpu
from megatron.model.config import GPTModelConfig


def residual_projection(
    cfg: GPTModelConfig, input_size: int, bias: bool, init_method: Callable
) -> mpu.RowParallelLinear:
    """``[s, b, input_size/tp]`` → ``([s, b, h], bias or None)``: the input is this rank's TP shard, the bias is
    returned unadded, and the output is reduced over TP unless ``gpt_j_residual`` (the layer then reduces once)."""
    return mpu.RowParallelLinear(
        input_size,
        cfg.hidden_size,
        bias=bias,
        input_is_parallel=True,
        init_method=init_method,
        skip_bias_add=True,
        params_dtype=cfg.params_dtype,
        parallel_output=cfg.gpt_j_residual,
        sequence_parallel=cfg.sequence_parallel,
        seq_dim=0,
    )
