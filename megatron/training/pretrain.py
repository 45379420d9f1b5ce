"""``pretrain(neox_args)``: GPT-NeoX's pretrain flow on the DeepSpeed engine.

initialize (distributed, mpu, seeds) → tokenizer (sets ``padded_vocab_size``) → metrics sinks → model →
optimizer + LR schedule → ``deepspeed.initialize`` → optional load → data loaders (resuming at the consumed
samples) → optional step-0 save → ``train()`` → final validation → final save → test evaluation.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron import mpu
from megatron.checkpoint.layout import CheckpointError
from megatron.errors import DataError
from megatron.evaluation.in_training import build_task_eval, char_counter_factory
from megatron.initialize import initialize_megatron
from megatron.logging.metrics import LoggingConfig, Metrics
from megatron.logging.peak_flops import flops_config_with_peak
from megatron.logging.run_observer import RunObserver
from megatron.logging.timers import Timers
from megatron.training import checkpointing as ckpt
from megatron.training.cpu_precision import apply_cpu_precision
from megatron.training.grad_clipping import install_fp32_clipping
from megatron.training.learning_rates import AnnealingLR, LRScheduleConfig
from megatron.training.loop import LoopConfig, LoopState, Trainer
from megatron.training.nonfinite import install_nonfinite_guard
from megatron.training.optimizers import OptimizerConfig, build_optimizer, deepspeed_config_for
from megatron.training.preemption import Preemption, PreemptionConfig
from megatron.training.single_rank import skip_single_rank_allreduce
from megatron.training.step import BatchConfig, PipeStep, SequentialStep

logger = logging.getLogger("megatron.train")


@dataclass
class PretrainResult:
    """What a run did (returned to callers and tests)."""

    iteration: int
    start_iteration: int
    train_losses: list[float] = field(default_factory=list)
    valid: dict[str, float] = field(default_factory=dict)
    test: dict[str, float] = field(default_factory=dict)
    saved: list[int] = field(default_factory=list)
    optimizer_class: str = ""  # DeepSpeed's final optimizer wrapper (e.g. DeepSpeedZeroOptimizer)
    zero_stage: int = 0
    params_dtype: str = ""
    skipped_iters: int = 0  # optimizer steps skipped (fp16 overflow or a non-finite loss/gradient)
    preempted: bool = False  # stopped by a signal or exit_duration_in_mins after saving: exit with REQUEUE_EXIT_CODE


def checkpoint_args(args: Any) -> dict[str, Any]:
    """The model-shape values GPT-NeoX stores in every checkpoint and checks on load."""
    return {k: getattr(args, k, None) for k in ckpt.CHECKPOINT_ARG_KEYS}


def build_model(args: Any) -> tuple[torch.nn.Module, Any]:
    """The GPT model for the config: sequential (``pipe_parallel_size == 0``) or a DeepSpeed PipelineModule."""
    from megatron import model as model_lib

    cfg = model_lib.GPTModelConfig.from_neox_args(args)
    if int(getattr(args, "pipe_parallel_size", 0) or 0) >= 1:
        return model_lib.build_pipeline_model(cfg), cfg
    model = model_lib.build_sequential_model(cfg)
    if getattr(args, "train_impl", "normal") == "rm":
        from megatron.post_training.reward_head import with_reward_head

        model = with_reward_head(model, cfg)
    return model, cfg


def setup_model_and_optimizer(args: Any, load_cfg: ckpt.CheckpointConfig) -> tuple[Any, AnnealingLR, int, Any]:
    """Model, optimizer, LR schedule, ``deepspeed.initialize`` and the optional load.

    Returns ``(engine, lr_scheduler, iteration, load_result)``.
    """
    import deepspeed

    from megatron.model.activation_checkpointing import ActivationCheckpointConfig, configure_activation_checkpointing
    from megatron.parallel_config import ParallelConfig

    opt_cfg = OptimizerConfig.from_neox_args(args)
    # The layout's rules (ZeRO-2/3 without the pipe engine; pipe activation partitioning off under SP).
    ds_config = ParallelConfig.from_neox_args(args).apply(deepspeed_config_for(args.deepspeed_config, opt_cfg))
    apply_cpu_precision(ds_config)
    configure_activation_checkpointing(ActivationCheckpointConfig.from_neox_args(args))
    model, _ = build_model(args)  # the builders also register the sequence-parallel norm-gradient sync
    optimizer, groups = build_optimizer(model, opt_cfg)
    lr_scheduler = AnnealingLR(optimizer, LRScheduleConfig.from_neox_args(args))
    pipe = int(getattr(args, "pipe_parallel_size", 0) or 0) >= 1
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=groups if optimizer is None else None,
        lr_scheduler=lr_scheduler,
        config=ds_config,
        mpu=None if pipe else mpu.get_deepspeed_mpu(),
        dist_init_required=False,
    )
    install_fp32_clipping(engine)  # DeepSpeed's fp32 clipping norm is wrong under pipelines (and unrecorded)
    skip_single_rank_allreduce(engine, mpu.get_data_parallel_world_size())  # 1 DP rank: nothing to reduce
    # DeepSpeed may wrap the optimizer (ZeRO, bf16): the schedule must write into the wrapper's groups.
    lr_scheduler.optimizer = engine.optimizer
    lr_scheduler.step(lr_scheduler.num_iters)
    result = ckpt.load_checkpoint(engine, load_cfg, checkpoint_args=checkpoint_args(args), args=args)
    if result.path and getattr(args, "checkpoint_validation_with_forward_pass", False):
        check_validation_logits(engine, args, result.client_state, result.path)
    return engine, lr_scheduler, result.iteration, result


def _train_iters_from_epochs(args: Any) -> None:
    """GPT-NeoX's ``update_iterations``: ``train_iters = train_epochs × micro-batches per epoch // gas``."""
    from megatron.data.data_utils import DataConfig, build_train_valid_test_data_loaders

    data_cfg = DataConfig.from_neox_args(args)
    data_cfg.validate()
    train_loader, _, _ = build_train_valid_test_data_loaders(
        data_cfg, dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size()
    )
    if train_loader is None:
        raise DataError("train_epochs needs training data")
    gas = int(args.gradient_accumulation_steps or 1)
    iters = int(args.train_epochs) * len(train_loader) // gas
    if iters < 1:
        raise DataError(f"train_epochs {args.train_epochs}: the training data holds less than one global batch")
    args.update_value("train_iters", iters)
    logger.info("train_epochs %d: %d iterations", args.train_epochs, iters)


VALIDATION_KEY = "checkpoint_validation_logits"


@torch.no_grad()
def validation_logits(engine: Any, args: Any) -> torch.Tensor | None:
    """Logits of a fixed sequence (``checkpoint_validation_with_forward_pass``); None for pipeline models."""
    if int(getattr(args, "pipe_parallel_size", 0) or 0) >= 1:
        logger.warning("checkpoint_validation_with_forward_pass is not supported with pipe_parallel_size >= 1")
        return None
    seq = int(args.seq_length)
    tokens = (torch.arange(seq, device=engine.device) % int(args.padded_vocab_size)).unsqueeze(0)  # [1, s]
    was_training = engine.module.training
    engine.module.eval()
    logits = engine(tokens).float().cpu()
    engine.module.train(was_training)
    return logits


def check_validation_logits(engine: Any, args: Any, client_state: dict[str, Any], path: str) -> None:
    """Compare the stored forward pass with one of the loaded model (dtype-aware tolerance)."""
    stored = client_state.get(VALIDATION_KEY)
    if stored is None:
        logger.warning("checkpoint %s has no %s to validate against", path, VALIDATION_KEY)
        return
    current = validation_logits(engine, args)
    if current is None:
        return
    tol = 1e-5 if args.params_dtype == torch.float32 else 2e-2
    if current.shape != stored.shape or not torch.allclose(current, stored.float(), atol=tol, rtol=tol):
        raise CheckpointError(f"checkpoint {path}: the loaded model does not reproduce the logits stored at save time")
    logger.info("checkpoint %s validated with a forward pass", path)


def _loss_fn(model: torch.nn.Module) -> Any:
    from megatron.model import cross_entropy
    from megatron.model.moe import with_aux_loss

    return with_aux_loss(cross_entropy, model)  # + the MoE load-balancing loss (unchanged for dense models)


def build_data_iterators(
    args: Any, consumed_train: int, consumed_valid: int
) -> tuple[Iterator[Any] | None, Iterator[Any] | None, Iterator[Any] | None]:
    """Endless train/valid/test batch iterators for this DP rank, resuming at the consumed sample counts."""
    from megatron.data.data_utils import DataConfig, build_train_valid_test_data_loaders
    from megatron.data.samplers import iterate_forever
    from megatron.post_training.data import build_post_training_loaders

    data_cfg = DataConfig.from_neox_args(args)
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    loaders = build_post_training_loaders(
        args, data_cfg, dp_rank=dp_rank, dp_size=dp_size, consumed_train=consumed_train, consumed_valid=consumed_valid
    )
    if loaders is None:
        data_cfg.validate()
        loaders = build_train_valid_test_data_loaders(
            data_cfg,
            dp_rank=dp_rank,
            dp_size=dp_size,
            consumed_train_samples=consumed_train,
            consumed_valid_samples=consumed_valid,
        )
    train, valid, test = (iterate_forever(loader) if loader is not None else None for loader in loaders)
    return train, valid, test


def _setup_tokenizer(args: Any) -> Any:
    """Build the tokenizer and set ``padded_vocab_size`` (and ``train_iters`` from ``train_epochs``)."""
    from megatron.tokenizer import TokenizerConfig, build_tokenizer, padded_vocab_size

    tokenizer = build_tokenizer(TokenizerConfig.from_neox_args(args))
    padded = padded_vocab_size(
        tokenizer.vocab_size, int(args.make_vocab_size_divisible_by), int(args.model_parallel_size or 1)
    )
    args.update_value("padded_vocab_size", padded)
    if getattr(args, "train_iters", None) is None and getattr(args, "train_epochs", None):
        _train_iters_from_epochs(args)
    return tokenizer


def _log_summary(rank: int, observer: RunObserver, iteration: int) -> None:
    if rank == 0:
        logger.info(observer.summary_line(iteration))


def pretrain(args: Any) -> PretrainResult:
    """Train as configured; every rank calls this. Raises a ``UserError`` for configuration/data/checkpoint mistakes."""
    start_time = time.monotonic()
    timers = Timers()
    initialize_megatron(args)
    rank = mpu.world_rank()
    tokenizer = _setup_tokenizer(args)
    loop_cfg = LoopConfig.from_neox_args(args)
    log_cfg = LoggingConfig.from_neox_args(args)
    save_cfg = ckpt.CheckpointConfig.from_neox_args(args)
    resolved = args.to_dict() if hasattr(args, "to_dict") else None
    run_config = {k: v for k, v in (resolved or {}).items() if k != "config_files"}
    metrics = Metrics.create(
        log_cfg,
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        run_config=run_config,
        config_text=args.format_config() if hasattr(args, "format_config") else None,
    )
    preemption = Preemption(PreemptionConfig.from_neox_args(args)).install()
    try:
        engine, _, iteration, loaded = setup_model_and_optimizer(args, save_cfg)
        tbs = int(args.train_batch_size)
        consumed_valid = (loaded.consumed_valid_samples or 0) if loaded.path else 0
        train_iter, valid_iter, test_iter = build_data_iterators(args, iteration * tbs, consumed_valid)

        batch_cfg = BatchConfig.from_neox_args(args, tokenizer.eod)
        if int(getattr(args, "pipe_parallel_size", 0) or 0) >= 1:
            step: PipeStep | SequentialStep = PipeStep(engine, batch_cfg, timers)
        else:
            from megatron.post_training.step import build_post_training_step

            gas = int(args.gradient_accumulation_steps or 1)
            step = build_post_training_step(args, engine, tokenizer.eod, gas, timers) or SequentialStep(
                engine, _loss_fn(engine.module), batch_cfg, gas, timers
            )
        result = PretrainResult(
            iteration=iteration,
            start_iteration=iteration,
            optimizer_class=type(engine.optimizer).__name__,
            zero_stage=int(engine.zero_optimization_stage()),
            params_dtype=str(next(engine.module.parameters()).dtype).removeprefix("torch."),
        )

        def save(it: int) -> None:
            extra = {}
            if getattr(args, "checkpoint_validation_with_forward_pass", False):
                extra[VALIDATION_KEY] = validation_logits(engine, args)
            ckpt.save_checkpoint(
                engine,
                it,
                save_cfg,
                checkpoint_args=checkpoint_args(args),
                consumed_train_samples=it * tbs,
                consumed_valid_samples=trainer.consumed_valid,
                config_files=getattr(args, "config_files", None) or {},
                resolved_config=resolved,
                extra_state=extra,
            )
            result.saved.append(it)
            observer.saved(os.path.join(save_cfg.save, f"global_step{it}"))

        observer = RunObserver(loop_cfg.train_iters, tbs, int(args.seq_length), iteration, start_time=start_time)
        trainer = Trainer(
            engine=engine,
            step=step,
            loop_cfg=loop_cfg,
            log_cfg=log_cfg,
            flops_cfg=flops_config_with_peak(args, rank),
            metrics=metrics,
            timers=timers,
            save_fn=save if save_cfg.save else None,
            is_save_iter=lambda it: ckpt.is_save_iter(it, save_cfg),
            profile_dir=log_cfg.log_dir or save_cfg.save or ".",
            task_eval=build_task_eval(engine, tokenizer, args),
            char_counter=char_counter_factory(tokenizer, args),
            observer=observer,
        )
        trainer.consumed_valid = consumed_valid
        install_nonfinite_guard(
            engine,
            int(getattr(args, "max_consecutive_nonfinite_steps", None) or 10),
            int(getattr(args, "loss_spike_skip_window", None) or 0),
            float(getattr(args, "loss_spike_skip_zscore", None) or 0.0),
        )
        trainer.stop_check = preemption.should_stop
        if save_cfg.save and iteration == 0 and 0 in save_cfg.extra_save_iters:
            save(0)
        state = trainer.train(LoopState(iteration=iteration), train_iter, valid_iter)
        result.iteration, result.train_losses = state.iteration, state.history
        result.skipped_iters = int(engine.skipped_steps)
        if state.preempted:
            result.preempted = True
            if save_cfg.save and state.iteration not in result.saved:
                save(state.iteration)
        if state.exited_early:
            _log_summary(rank, observer, state.iteration)
            return result
        if valid_iter is not None and loop_cfg.eval_iters > 0:
            result.valid = trainer.evaluate("validation", valid_iter, state.iteration)
        if save_cfg.save and state.iteration != 0 and state.iteration not in result.saved:
            save(state.iteration)
        if test_iter is not None and loop_cfg.eval_iters > 0:
            result.test = trainer.evaluate("test", test_iter, state.iteration)
        _log_summary(rank, observer, state.iteration)
        return result
    finally:
        preemption.uninstall()
        metrics.close()
