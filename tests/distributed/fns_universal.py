"""DeepSpeed universal checkpoints on spawned ranks: save, convert with DeepSpeed's ``ds_to_universal``, and resume
with ``load_universal`` in other layouts (tests/distributed/test_universal_checkpoint.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron import mpu
from tests.distributed import fns_parallel as fp

SAVE_AT, TOTAL = 2, 4
UNIVERSAL_DS = {"checkpoint": {"load_universal": True}}
# untied output layer, gated MLP ([up_r|gate_r] shards), GQA ([Q_r|K_r|V_r] shards): every TP category
VARIANT: dict[str, Any] = {
    "tied": False,
    "zero": 1,
    "model": {"activation": "swiglu", "mlp_multiple_of": 8, "num_attention_heads": 4, "num_kv_heads": 2},
}


def _args() -> dict[str, Any]:
    return {"num_layers": fp.LAYERS, "hidden_size": fp.HIDDEN, "padded_vocab_size": fp.VOCAB}


def _engine(tp: int, zero: int, seed: int, universal: bool, variant: dict[str, Any]) -> tuple[Any, Any, int]:
    from megatron.initialize import set_random_seed

    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tp, 1)
    set_random_seed(seed, pipe_rank=0, pipe_size=1, model_parallel_size=tp)
    micro = fp.GLOBAL_BATCH // (fp.GAS * mpu.get_data_parallel_world_size())
    model = dict(variant, model={**variant.get("model", {}), "seed": seed})
    engine, cfg = fp.build_engine(model, False, micro, zero, UNIVERSAL_DS if universal else None)
    return engine, cfg, micro


def _resume(directory: str, tp: int, zero: int, universal: bool, variant: dict[str, Any]) -> dict[str, Any]:
    """A fresh engine (another seed) that loads ``directory`` and trains to TOTAL; its losses, or the load error."""
    from megatron import checkpoint as ckpt

    engine, cfg, micro = _engine(tp, zero, fp.SEED + 17, universal, variant)
    load_cfg = ckpt.CheckpointConfig(load=directory, load_universal=universal)
    try:
        loaded = ckpt.load_checkpoint(engine, None, load_cfg, checkpoint_args=_args(), model=cfg)
    except ckpt.CheckpointError as e:
        return {"error": str(e)}
    losses = fp.train_steps(engine, False, micro, loaded.iteration, TOTAL - loaded.iteration)
    return {"iteration": loaded.iteration, "losses": losses, "zero": int(engine.zero_optimization_stage())}


def save_convert_resume(
    directory: str, source: tuple[int, int], targets: list[tuple[int, int]], variant: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train ``source`` = (tp, zero) to TOTAL saving at SAVE_AT, convert that checkpoint with DeepSpeed's converter
    (rank 0, ``convert_to_universal``), then resume it plainly at the source layout and with ``load_universal`` at
    every ``(tp, zero)`` of ``targets``."""
    from megatron import checkpoint as ckpt

    variant = variant or VARIANT
    tp, zero = source
    engine, cfg, micro = _engine(tp, zero, fp.SEED, False, variant)
    fp.train_steps(engine, False, micro, 0, SAVE_AT)
    ckpt.save_checkpoint(
        engine, None, SAVE_AT, ckpt.CheckpointConfig(save=directory), checkpoint_args=_args(),
        consumed_train_samples=0, model=cfg,
    )  # fmt: skip
    uninterrupted = fp.train_steps(engine, False, micro, SAVE_AT, TOTAL - SAVE_AT)
    universal = None
    if mpu.world_rank() == 0:
        universal = str(ckpt.convert_to_universal(Path(directory) / ckpt.checkpoint_tag(SAVE_AT)))
    mpu.barrier()
    out: dict[str, Any] = {"uninterrupted": uninterrupted, "universal": universal}
    out["plain"] = _resume(directory, tp, zero, False, variant)
    for target in targets:
        out[target] = _resume(directory, *target, True, variant)
    mpu.destroy_model_parallel()
    return out
