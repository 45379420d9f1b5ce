"""GPT-NeoX's ``megatron.training`` / ``megatron.checkpointing`` functions, with GPT-NeoX's signatures, over ours.

Scripts written against GPT-NeoX build a model with ``setup_model_and_optimizer(neox_args)`` and save or load it
with ``save_checkpoint(neox_args, iteration, model, optimizer, lr_scheduler)`` /
``load_checkpoint(neox_args, model, optimizer, lr_scheduler)``; these call the same code ``pretrain()`` runs.
``model`` is the DeepSpeed engine, as in GPT-NeoX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron import checkpoint as ckpt
from megatron import mpu
from megatron.initialize import initialize_megatron
from megatron.model import GPTModelConfig
from megatron.tokenizer import build_neox_args_tokenizer
from megatron.training import pretraining as pretrain_lib
from megatron.training.run_plan import RunPlan


def pretrain(neox_args: Any) -> pretrain_lib.PretrainResult:
    """GPT-NeoX's ``pretrain(neox_args)``: train as configured (every rank calls it)."""
    return pretrain_lib.pretrain(neox_args)


def setup_model_and_optimizer(
    neox_args: Any, use_cache: bool = False, iteration: int | None = None
) -> tuple[Any, Any, Any]:
    """Build the model, optimizer and LR schedule under DeepSpeed and load ``load`` (at ``iteration`` if given);
    returns ``(model, optimizer, lr_scheduler)`` and sets the ``iteration`` key to the loaded iteration. As in
    GPT-NeoX, ``model.step()`` moves ``lr_scheduler`` (the engine holds it).

    Initialises distributed state and the tokenizer when the caller has not (GPT-NeoX requires both first).
    ``use_cache`` is accepted for GPT-NeoX's signature: our sequential model takes its KV cache per call.
    """
    del use_cache
    if not mpu.model_parallel_is_initialized():
        initialize_megatron(neox_args)
    if neox_args.padded_vocab_size is None:
        build_neox_args_tokenizer(neox_args)
    plan = RunPlan.from_neox_args(neox_args)
    load_cfg = ckpt.CheckpointConfig.from_neox_args(neox_args)
    if iteration is not None:
        load_cfg = dataclasses.replace(load_cfg, iteration=iteration)
    setup = pretrain_lib.ModelSetup.from_neox_args(neox_args)
    # GPT-NeoX's engine moves the LR at engine.step(): callers of this API drive that loop themselves
    engine, lr_scheduler, loaded, _ = pretrain_lib.setup_model_and_optimizer(
        setup, plan, load_cfg, engine_steps_lr=True
    )
    neox_args.update_value("iteration", loaded)
    return engine, engine.optimizer, lr_scheduler


def save_checkpoint(neox_args: Any, iteration: int, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
    """Save ``model`` (the DeepSpeed engine, which holds the optimizer) and ``lr_scheduler`` as ``global_step<iteration>``
    under ``save``, with GPT-NeoX's files; every rank calls it. With ``s3_path``, rank 0 uploads the checkpoint
    before it returns (waiting at most ``s3_flush_timeout``)."""
    del optimizer  # saved through the engine
    cfg = ckpt.CheckpointConfig.from_neox_args(neox_args)
    uploads = ckpt.start_uploads(cfg)  # s3_path: uploaded before returning, as GPT-NeoX does
    ckpt.save_checkpoint(
        model,
        lr_scheduler,
        iteration,
        cfg,
        checkpoint_args=pretrain_lib.ModelSetup.from_neox_args(neox_args).checkpoint_args,
        consumed_train_samples=iteration * neox_args.train_batch_size,
        config_files=neox_args.config_files or {},
        resolved_config=neox_args.all_config,  # GPT-NeoX's name for every key with its value
        uploads=uploads,
        model=GPTModelConfig.from_neox_args(neox_args),
    )
    if uploads is not None:
        uploads.close()
    mpu.barrier()


def load_checkpoint(
    neox_args: Any,
    model: Any,
    optimizer: Any,
    lr_scheduler: Any,
    inference: bool = False,
    iteration: int | None = None,
) -> int:
    """Load ``load`` (its ``latest``, or ``iteration``) into ``model`` (the DeepSpeed engine); returns the iteration
    (0 when there is nothing to load). ``inference`` loads the weights only, as does ``finetune``."""
    del optimizer  # restored through the engine
    cfg = ckpt.CheckpointConfig.from_neox_args(neox_args)
    if iteration is not None:
        cfg = dataclasses.replace(cfg, iteration=iteration)
    if inference:
        cfg = dataclasses.replace(cfg, no_load_optim=True, no_load_rng=True)
    result = ckpt.load_checkpoint(
        model,
        lr_scheduler,
        cfg,
        checkpoint_args=pretrain_lib.ModelSetup.from_neox_args(neox_args).checkpoint_args,
        model=GPTModelConfig.from_neox_args(neox_args),
    )
    return result.iteration
