"""DeepSpeed universal checkpoints on spawned ranks: save, convert with DeepSpeed's ``ds_to_universal``, and resume
with ``load_universal`` in other layouts (tests/distributed/test_universal_checkpoint.py).

A layout is ``(tp, pp, zero)``: ``pp`` 0 is the sequential model, ``pp`` >= 1 DeepSpeed's pipeline engine with that
many stages; the data-parallel size is what the world leaves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron import mpu
from tests.distributed import fns_parallel as fp

SAVE_AT, TOTAL = 2, 4
UNIVERSAL_DS = {"checkpoint": {"load_universal": True}}
Layout = tuple[int, int, int]
# untied output layer, gated MLP ([up_r|gate_r] shards), GQA ([Q_r|K_r|V_r] shards): every TP category
VARIANT: dict[str, Any] = {
    "tied": False,
    "zero": 1,
    "model": {"activation": "swiglu", "mlp_multiple_of": 8, "num_attention_heads": 4, "num_kv_heads": 2},
}


def _args() -> dict[str, Any]:
    return {"num_layers": fp.LAYERS, "hidden_size": fp.HIDDEN, "padded_vocab_size": fp.VOCAB}


def _engine(layout: Layout, seed: int, universal: bool, variant: dict[str, Any]) -> tuple[Any, Any, int, bool]:
    from megatron.initialize import set_random_seed

    tp, pp, zero = layout
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tp, max(pp, 1))
    set_random_seed(
        seed,
        pipe_rank=mpu.get_pipe_parallel_rank(),
        pipe_size=mpu.get_pipe_parallel_world_size(),
        model_parallel_size=tp,
    )
    micro = fp.GLOBAL_BATCH // (fp.GAS * mpu.get_data_parallel_world_size())
    model = dict(variant, model={**variant.get("model", {}), "seed": seed})
    engine, cfg = fp.build_engine(model, pp >= 1, micro, zero, UNIVERSAL_DS if universal else None)
    return engine, cfg, micro, pp >= 1


def _resume(directory: str, layout: Layout, variant: dict[str, Any], **load: Any) -> dict[str, Any]:
    """A fresh engine (another seed) that loads ``directory`` (``load``: CheckpointConfig fields) and trains to
    TOTAL; its losses, or the load error."""
    from megatron import checkpoint as ckpt

    universal = bool(load.get("load_universal")) and not load.pop("unflagged", False)
    engine, cfg, micro, pipe = _engine(layout, fp.SEED + 17, universal, variant)
    load_cfg = ckpt.CheckpointConfig(load=directory, **load)
    try:
        loaded = ckpt.load_checkpoint(engine, None, load_cfg, checkpoint_args=_args(), model=cfg)
    except ckpt.CheckpointError as e:
        return {"error": str(e)}
    losses = fp.train_steps(engine, pipe, micro, loaded.iteration, TOTAL - loaded.iteration)
    return {"iteration": loaded.iteration, "losses": losses, "zero": int(engine.zero_optimization_stage())}


def save_convert_resume(
    directory: str,
    source: Layout,
    targets: list[Layout],
    variant: dict[str, Any] | None = None,
    unflagged: bool = False,
) -> dict[str, Any]:
    """Train at ``source`` to TOTAL saving at SAVE_AT, convert that checkpoint with DeepSpeed's converter (rank 0,
    ``convert_to_universal``), then resume it plainly at the source layout, with a fresh optimizer state
    (``no_load_optim``), and with ``load_universal`` at every layout of ``targets`` (``unflagged``: also at the
    source layout by an engine built without DeepSpeed's ``checkpoint.load_universal``)."""
    from megatron import checkpoint as ckpt

    variant = variant or VARIANT
    engine, cfg, micro, pipe = _engine(source, fp.SEED, False, variant)
    fp.train_steps(engine, pipe, micro, 0, SAVE_AT)
    ckpt.save_checkpoint(
        engine, None, SAVE_AT, ckpt.CheckpointConfig(save=directory), checkpoint_args=_args(),
        consumed_train_samples=0, model=cfg,
    )  # fmt: skip
    uninterrupted = fp.train_steps(engine, pipe, micro, SAVE_AT, TOTAL - SAVE_AT)
    universal = None
    if mpu.world_rank() == 0:
        universal = str(ckpt.convert_to_universal(Path(directory) / ckpt.checkpoint_tag(SAVE_AT)))
    mpu.barrier()
    out: dict[str, Any] = {"uninterrupted": uninterrupted, "universal": universal}
    out["plain"] = _resume(directory, source, variant)
    out["fresh_optimizer"] = _resume(directory, source, variant, no_load_optim=True)
    for target in targets:
        out[target] = _resume(directory, target, variant, load_universal=True)
    if unflagged:
        out["unflagged"] = _resume(directory, source, variant, load_universal=True, unflagged=True)
    mpu.destroy_model_parallel()
    return out
