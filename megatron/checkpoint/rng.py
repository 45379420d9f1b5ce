"""The RNG states a checkpoint carries (GPT-NeoX's client-state keys)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from megatron import mpu
from megatron.checkpoint.layout import CheckpointError


def rng_state() -> dict[str, Any]:
    """The RNG states GPT-NeoX saves (python, numpy, torch, accelerator, model-parallel tracker)."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": mpu.get_cuda_rng_tracker().get_states(),
    }
    return state


def set_rng_state(state: dict[str, Any], path: str) -> None:
    """Restore :func:`rng_state` output; a missing key is a clear error."""
    try:
        random.setstate(state["random_rng_state"])
        np.random.set_state(state["np_rng_state"])
        torch.set_rng_state(state["torch_rng_state"])
        if torch.cuda.is_available() and state["cuda_rng_state"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng_state"])
        mpu.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    except KeyError as e:
        raise CheckpointError(
            f"checkpoint {path} has no RNG state {e.args[0]!r}; set no_load_rng: true (or finetune) to load it"
        ) from None
