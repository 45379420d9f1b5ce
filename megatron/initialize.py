"""Process start-up for training and inference: distributed init, model-parallel groups, seeds."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron import mpu
from megatron.config_utils import NeoXValues, neox_overrides
from megatron.distributed import init_distributed, on_cpu
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.sections.deepspeed import GradientReduceKeys
from megatron.neox_arguments.sections.other import DistributedKeys, ParallelSizeKeys, SeedKeys

logger = logging.getLogger(__name__)


@dataclass
class InitConfig(SeedKeys, ParallelSizeKeys, GradientReduceKeys, DistributedKeys):
    """GPT-NeoX keys used at start-up."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> InitConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        values = neox_overrides(cls, args)
        return cls(**values)


def set_random_seed(seed: int, *, pipe_rank: int = 0, pipe_size: int = 1, model_parallel_size: int = 1) -> int:
    """Seed python, numpy, torch and the model-parallel RNG tracker; returns the seed used on this rank.

    As GPT-NeoX, interior pipeline stages offset the seed by ``1138 + stage · mp`` (the first and last stage,
    which hold the tied embeddings, keep ``seed``).
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed <= 0:
        raise ConfigError(f"seed must be a positive integer, got {seed!r}")
    if 0 < pipe_rank < pipe_size - 1:
        seed = seed + 1138 + pipe_rank * model_parallel_size
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    mpu.model_parallel_cuda_manual_seed(seed)
    return seed


def initialize_megatron(neox_args: Any, allow_no_cuda: bool = False) -> InitConfig:
    """``torch.distributed`` (gloo on CPU, nccl on CUDA; SLURM/MPI env discovery), mpu groups, seeds.

    GPT-NeoX's signature; ``allow_no_cuda`` is accepted and needs nothing here (every path runs on CPU)."""
    del allow_no_cuda
    return start_processes(InitConfig.from_neox_args(neox_args))


def start_processes(cfg: InitConfig) -> InitConfig:
    """``torch.distributed`` (gloo on CPU, nccl on CUDA; SLURM/MPI env discovery), mpu groups, seeds, per ``cfg``."""
    backend = cfg.distributed_backend

    if on_cpu() and backend != "gloo":
        logger.info("distributed_backend %s is not available on CPU: using gloo", backend)
        backend = "gloo"
    init_distributed(backend, timeout_minutes=cfg.distributed_timeout_minutes)
    mpu.initialize_model_parallel(cfg.model_parallel_size, cfg.pipe_parallel_size)
    mpu.set_fp32_allreduce(cfg.fp32_allreduce)
    set_random_seed(
        cfg.seed,
        pipe_rank=mpu.get_pipe_parallel_rank(),
        pipe_size=mpu.get_pipe_parallel_world_size(),
        model_parallel_size=mpu.get_model_parallel_world_size(),
    )
    return cfg
