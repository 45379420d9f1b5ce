"""RNG for tensor parallelism: DeepSpeed's tracker semantics, usable on CPU.

Two streams: the default accelerator generator (seeded with ``seed``; identical across a TP group, used for
hidden dropout) and the tracker's ``"model-parallel-rng"`` stream (seeded with ``seed + 2718 + tp_rank``;
differs across TP ranks, used for dropout inside TP regions such as attention probabilities). The tracker
object is DeepSpeed's own, so :func:`checkpoint` (DeepSpeed's activation checkpointing) restores both streams
when it recomputes a forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from megatron.mpu.initialize import get_model_parallel_rank

logger = logging.getLogger(__name__)

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718


def get_cuda_rng_tracker() -> ds_checkpointing.CudaRNGStatesTracker:
    """DeepSpeed's RNG-state tracker (``with get_cuda_rng_tracker().fork(): ...`` uses the TP stream)."""
    return ds_checkpointing.get_cuda_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default accelerator generator with ``seed`` and the TP stream with ``seed + 2718 + tp_rank``.

    Unlike DeepSpeed's function it needs neither ``deepspeed.checkpointing.configure`` nor an initialised
    process group (TP rank 0 before model-parallel initialisation).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    tp_rank = get_model_parallel_rank()
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    get_accelerator().manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    logger.debug("seeded default stream %d and model-parallel stream %d", seed, seed + 2718 + tp_rank)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Activation checkpointing of ``function(*args)`` that replays the default and TP RNG streams on recompute.

    DeepSpeed's reentrant implementation: at least one tensor argument must require grad.
    """
    return deepspeed.checkpointing.checkpoint(function, *args)
