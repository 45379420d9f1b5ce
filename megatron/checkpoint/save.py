"""Saving a training run's checkpoint: DeepSpeed's layout with GPT-NeoX's names.

```
<save>/latest                                   "global_step<N>" (replaced atomically by the commit)
<save>/global_step<N>/
  configs/<yaml basename>, configs/resolved_config.json
  mp_rank_XX_model_states.pt                    engine state + our client state (iteration, args, rng, data position)
  layer_LL-model_TT-model_states.pt             pipe models only
  [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt   ZeRO optimizer shards
  manifest.json                                 written last by rank 0: sizes/sha256 of every file, iteration,
                                                consumed samples, layout, resolved config
```

Saves are crash-safe (``megatron.checkpoint.commit``); ``no_save_optim`` / ``no_save_rng`` leave those states out.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from megatron import mpu
from megatron.checkpoint import commit as commit_lib
from megatron.checkpoint import state_checks
from megatron.checkpoint.bias_layout import ROW_BIAS_KEY, row_biases_on_disk, written_layout
from megatron.checkpoint.commit import delete_old_checkpoints
from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.lr_state import LR_SCHEDULER_KEY, LRSchedule
from megatron.checkpoint.manifest import write_manifest
from megatron.checkpoint.rng import rng_state
from megatron.checkpoint.run_config import CheckpointConfig
from megatron.checkpoint.s3_upload import S3Uploader
from megatron.checkpoint.safe_load import safe_torch_load
from megatron.checkpoint.tags import checkpoint_tag
from megatron.checkpoint.universal import UNIVERSAL_INFO_KEY, universal_info
from megatron.engine_protocol import Engine
from megatron.model.config import GPTModelConfig

logger = logging.getLogger(__name__)


def _write_configs(directory: Path, config_files: dict[str, str] | None, resolved: dict[str, Any] | None) -> None:
    configs = directory / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    for name, text in (config_files or {}).items():
        (configs / os.path.basename(name)).write_text(text)
    if resolved is not None:
        (configs / "resolved_config.json").write_text(json.dumps(resolved, indent=2, sort_keys=True, default=str))


def _strip_optimizer_states(directory: Path, zero_stage: int) -> None:
    """``no_save_optim``: drop optimizer state written by this rank (weights stay loadable)."""
    rank = mpu.world_rank()
    if zero_stage >= 3:
        logger.warning("no_save_optim is ignored with ZeRO-3: the fp32 weights live in the optimizer shards")
        return
    for path in directory.glob("*optim_states.pt"):
        if f"zero_pp_rank_{rank}_" in path.name or (zero_stage == 0 and rank == 0):
            path.unlink(missing_ok=True)
    if rank == 0:
        for path in directory.glob("mp_rank_*_model_states.pt"):
            state = safe_torch_load(path)
            state["optimizer"] = None
            torch.save(state, path)


def save_checkpoint(
    engine: Engine,
    lr_scheduler: LRSchedule | None,
    iteration: int,
    cfg: CheckpointConfig,
    *,
    checkpoint_args: dict[str, Any],
    consumed_train_samples: int,
    consumed_valid_samples: int = 0,
    config_files: dict[str, str] | None = None,
    resolved_config: dict[str, Any] | None = None,
    extra_state: dict[str, Any] | None = None,
    run_id: str = "",
    uploads: S3Uploader | None = None,
    model: GPTModelConfig | None = None,
) -> Path:
    """Save through ``engine.save_checkpoint`` under tag ``global_step<iteration>`` (all ranks must call), with the
    LR schedule's state in the model-states files' ``lr_scheduler`` entry, where DeepSpeed puts an engine's own.

    ``run_id`` (from the save folder's lock) names the temporary folder, and the cleanup before the save only
    removes this run's; without it every leftover temporary folder is removed. ``uploads`` (rank 0's, with
    ``s3_path``) is handed the checkpoint after its commit and uploads it in the background.

    With ``model`` (the run's model config) the model-states files also carry ``universal_checkpoint_info``, what
    DeepSpeed's ``ds_to_universal`` needs to convert the checkpoint (``megatron.checkpoint.universal``).
    """
    if not cfg.save:
        raise CheckpointError("save_checkpoint needs the 'save' directory")
    tag = checkpoint_tag(iteration)
    client_state: dict[str, Any] = {
        "iteration": iteration,
        "args": dict(checkpoint_args),
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
    }
    if not cfg.no_save_rng:
        client_state.update(rng_state())
    client_state.update(extra_state or {})
    if lr_scheduler is not None:
        client_state[LR_SCHEDULER_KEY] = lr_scheduler.state_dict()
    tp = int(checkpoint_args.get("model_parallel_size") or 1)
    zero_stage = _zero_stage(engine)  # what the engine writes (its config's zero_optimization.stage)
    bias_layout = written_layout(cfg.gpt_j_residual, tp, zero_stage)
    client_state[ROW_BIAS_KEY] = bias_layout
    if model is not None:
        client_state[UNIVERSAL_INFO_KEY] = _universal_info(engine, model)
    rank = mpu.world_rank()
    state_checks.check_state_before_save(engine, cfg.save, tag, optimizer=not cfg.no_save_optim or zero_stage >= 3)
    directory = Path(cfg.save) / commit_lib.partial_tag(tag, run_id)
    if rank == 0:
        commit_lib.clean_partials(cfg.save, run_id or None)
    mpu.barrier()
    with commit_lib.write_errors(cfg.save, tag):  # disk full: one line, the previous checkpoint stays
        with row_biases_on_disk(engine.module, bias_layout, tp):
            engine.save_checkpoint(cfg.save, tag=directory.name, client_state=client_state, save_latest=False)
        if cfg.no_save_optim:
            mpu.barrier()
            _strip_optimizer_states(directory, zero_stage)
        if rank == 0:
            _write_configs(directory, config_files, resolved_config)
        mpu.barrier()
        if rank == 0:
            world = mpu.world_size()
            meta = {"tag": tag, "iteration": iteration, "consumed_train_samples": consumed_train_samples}
            meta.update(consumed_valid_samples=consumed_valid_samples, layout=_layout(engine, world))
            meta[ROW_BIAS_KEY] = bias_layout
            write_manifest(directory, **meta, config=resolved_config)
            directory = commit_lib.commit(cfg.save, tag, run_id)
            if uploads is not None:
                uploads.submit(tag)
            if cfg.keep_last_n_checkpoints is not None:
                keep = uploads.pending() if uploads is not None else ()
                delete_old_checkpoints(cfg.save, cfg.keep_last_n_checkpoints, new=tag, keep=keep)
    mpu.barrier()
    directory = Path(cfg.save) / tag
    if rank == 0:
        logger.info("saved checkpoint %s at iteration %d", directory, iteration)
    return directory


def _universal_info(engine: Engine, model: GPTModelConfig) -> dict[str, Any]:
    """``universal_checkpoint_info`` over every rank's parameters (a pipeline stage holds only its own; DeepSpeed's
    converter reads the info of the first model-states file)."""
    mine = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters() if p.requires_grad}
    shapes: dict[str, tuple[int, ...]] = {}
    for part in mpu.all_gather_objects(mine) if mpu.world_size() > 1 else [mine]:
        shapes.update(part)
    tp = mpu.get_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    return universal_info(shapes, model, tp)


def _zero_stage(engine: Engine) -> int:
    return int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0


def _layout(engine: Engine, world: int) -> dict[str, int]:
    tp = mpu.get_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    dp = mpu.get_data_parallel_world_size() if mpu.model_parallel_is_initialized() else world
    zero = _zero_stage(engine)
    return {"world_size": world, "tp": tp, "dp": dp, "pp": max(world // max(tp * dp, 1), 1), "zero_stage": zero}
