"""Save and resume under a 3D layout (run on spawned ranks): exact continuation through the training checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatron import mpu
from tests.distributed import fns_parallel as fp

# Tied embeddings, checkpointed layers, dropout on (so the RNG state must come back too), ZeRO-1.
RESUME_VARIANT: dict[str, Any] = {
    "tied": True,
    "zero": 1,
    "ckpt": 1,
    "model": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
}
# Untied, ZeRO-3 where allowed, dropout on: the variant saved and resumed in every layout of the matrix.
MATRIX_VARIANT: dict[str, Any] = {
    "tied": False,
    "zero": 3,
    "model": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
}
SAVE_AT, TOTAL = 3, 6


def _checkpoint_cfg(directory: str) -> Any:
    from megatron.checkpoint import CheckpointConfig

    return CheckpointConfig(save=directory, load=directory)


def _args() -> dict[str, Any]:
    return {"num_layers": fp.LAYERS, "hidden_size": fp.HIDDEN, "padded_vocab_size": fp.VOCAB}


def save_and_resume(tp: int, pp: int, directory: str, variant: dict[str, Any] | None = None) -> dict[str, Any]:
    """Uninterrupted run of TOTAL steps saving at SAVE_AT, then a fresh engine (other seed) that loads and resumes.

    Returns both loss tails, both final weights (rank 0), the checkpoint's file names and the resumed iteration.
    """
    from megatron import checkpoint as ckpt
    from megatron.initialize import set_random_seed
    from megatron.model.full_weights import gather_full_state_dict

    variant = variant or RESUME_VARIANT
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tp, pp)
    pipe = pp > 1
    zero = 1 if pipe and variant["zero"] >= 2 else variant["zero"]
    micro = fp.GLOBAL_BATCH // (fp.GAS * mpu.get_data_parallel_world_size())
    cfg_ckpt = _checkpoint_cfg(directory)

    def seed(value: int) -> None:
        set_random_seed(
            value,
            pipe_rank=mpu.get_pipe_parallel_rank(),
            pipe_size=mpu.get_pipe_parallel_world_size(),
            model_parallel_size=mpu.get_model_parallel_world_size(),
        )

    seed(fp.SEED)
    engine, cfg = fp.build_engine(variant, pipe, micro, zero)
    first = fp.train_steps(engine, pipe, micro, 0, SAVE_AT)
    ckpt.save_checkpoint(engine, None, SAVE_AT, cfg_ckpt, checkpoint_args=_args(), consumed_train_samples=0)
    uninterrupted = fp.train_steps(engine, pipe, micro, SAVE_AT, TOTAL - SAVE_AT)
    full_a = gather_full_state_dict(engine, cfg)

    # A different seed: the load, not the initialisation, must restore the weights and RNG streams.
    seed(fp.SEED + 17)
    other = dict(variant, model={**variant.get("model", {}), "seed": fp.SEED + 17})
    engine_b, cfg_b = fp.build_engine(other, pipe, micro, zero)
    loaded = ckpt.load_checkpoint(engine_b, None, cfg_ckpt, checkpoint_args=_args())
    resumed = fp.train_steps(engine_b, pipe, micro, loaded.iteration, TOTAL - loaded.iteration)
    full_b = gather_full_state_dict(engine_b, cfg_b)

    tag_dir = Path(directory) / ckpt.checkpoint_tag(SAVE_AT)
    files = sorted(os.listdir(tag_dir)) if tag_dir.is_dir() else []
    mpu.destroy_model_parallel()
    return {
        "first": first,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "iteration": loaded.iteration,
        "zero": int(engine_b.zero_optimization_stage()),
        "files": files,
        "full_a": fp._to_numpy(full_a),
        "full_b": fp._to_numpy(full_b),
    }
