"""A trained checkpoint's weights for generation and evaluation, and the device and dtype they run in.

Below both the single-process (``text_generation``) and the N-rank (``parallel``) generation paths, which share it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from megatron.checkpoint import NeoXCheckpoint, read_checkpoint
from megatron.cpu_features import cpu_has_native
from megatron.distributed import on_cpu
from megatron.generation.config import InferenceConfig
from megatron.model.config import GPTModelConfig
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.precision import PRECISION_NAMES, dtype_of_precision

logger = logging.getLogger(__name__)


def load_checkpoint_for_inference(
    cfg: InferenceConfig,
    keep_for: Callable[[GPTModelConfig], Callable[[str], bool]] | None = None,
    tp_shard: tuple[int, int] | None = None,
) -> NeoXCheckpoint:
    """The checkpoint in ``load``, whatever its TP/PP/ZeRO layout (full tensors unless ``tp_shard`` applies).

    Uses ``megatron.checkpoint.reader`` (TP shards merged, pipeline layer files renamed to the sequential model's
    names, ZeRO-3 fp32 shards gathered); the model keys come from ``cfg``, the vocabulary padding from the
    checkpoint. ``keep_for`` and ``tp_shard``: see :func:`megatron.checkpoint.reader.read_checkpoint` (read only
    part of the model; only one TP rank's shards).
    """
    return read_checkpoint(
        cfg.checkpoint_dir, model=cfg.model_config, iteration=cfg.iteration, keep_for=keep_for, tp_shard=tp_shard
    )


def load_module_state(load_dir: str, iteration: int | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The full state dict of a checkpoint (model config from its own ``configs/``); returns ``(sd, tag)``."""
    ckpt = read_checkpoint(load_dir, iteration=iteration)
    return ckpt.state_dict, ckpt.layout.tag


def inference_dtype(inference_precision: str | None, cfg: Any) -> torch.dtype:
    """The dtype generation and evaluation run in: ``inference_precision`` if set (``fp32`` upcasts half-precision
    weights), else the model config's ``params_dtype`` (bf16/fp16 weights are kept, not upcast)."""
    if inference_precision is None:
        dtype = cfg.params_dtype
    elif str(inference_precision).lower() in PRECISION_NAMES:
        dtype = dtype_of_precision(inference_precision)
    else:
        raise ConfigError(f"inference_precision={inference_precision!r} is not one of fp32, fp16, bfloat16 (or unset)")
    half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if half is not None and inference_device().type == "cpu" and not cpu_has_native(half):
        logger.warning(
            "%s inference on a CPU without native %s matrix products (emulated, about 20-50x slower than fp32); "
            "set inference_precision: fp32 to upcast",
            half,
            half,
        )
    return dtype


def inference_device() -> torch.device:
    """CUDA when a GPU is used, else the CPU."""
    return torch.device("cpu") if on_cpu() else torch.device("cuda", torch.cuda.current_device())
