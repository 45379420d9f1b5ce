"""``pretrain(neox_args)``: GPT-NeoX's pretrain flow on the DeepSpeed engine.

initialize (distributed, mpu, seeds) → the run's shape (:class:`RunPlan`, decided once) → tokenizer (the padded vocabulary size, and ``train_iters`` from
``train_epochs``, derived into the run's copy of the arguments) → metrics sinks → model → optimizer + LR schedule → ``deepspeed.initialize`` → optional
load → data loaders (resuming at the consumed samples) → the step variant → optional step-0 save → ``train()`` →
final validation → final save → test evaluation.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import deepspeed
import torch
from deepspeed.runtime.pipe.engine import PipelineEngine as DeepSpeedPipelineEngine

from megatron import checkpoint as ckpt
from megatron import model as model_lib
from megatron import mpu
from megatron.checkpoint import CheckpointError, tokenizer_identity
from megatron.data.data_utils import DataConfig, build_train_valid_test_data_loaders, check_datasets
from megatron.data.samplers import iterate_forever
from megatron.engine_protocol import Engine
from megatron.errors import DataError
from megatron.evaluation.config import EvalConfig
from megatron.evaluation.in_training import build_task_eval, char_counter_factory
from megatron.initialize import initialize_megatron
from megatron.logging.flops import FlopsConfig
from megatron.logging.metrics import LoggingConfig, Metrics
from megatron.logging.peak_flops import flops_config_with_peak
from megatron.logging.run_observer import RunObserver
from megatron.logging.timers import Timers
from megatron.model.activation_checkpointing import ActivationCheckpointConfig, configure_activation_checkpointing
from megatron.model.moe import with_aux_loss
from megatron.model.mup import MupConfig
from megatron.model.soft_prompt import soft_prompt_tokens, with_prompt_init
from megatron.neox_arguments import NeoXArgs
from megatron.parallel_config import ParallelConfig
from megatron.post_training.config import PostTrainingConfig
from megatron.post_training.data import build_post_training_loaders, builds_own_data
from megatron.post_training.reward_head import with_reward_head
from megatron.tokenizer import TokenizerConfig, build_tokenizer, padded_vocab_size
from megatron.training.coord_check import run_coord_check
from megatron.training.cpu_precision import apply_cpu_precision
from megatron.training.curriculum import CurriculumConfig, build_curriculum
from megatron.training.deepspeed_adapter import share_fp32_zero3_partitions, skip_single_rank_allreduce
from megatron.training.learning_rates import AnnealingLR, LRScheduleConfig
from megatron.training.loop import LoopConfig, LoopState, Trainer
from megatron.training.mup_setup import prepare_mup, save_base_shapes
from megatron.training.nonfinite import StepGuard, build_step_guard
from megatron.training.online_setup import OnlineSetup, setup_online
from megatron.training.optimizers import OptimizerConfig, build_optimizer, deepspeed_config_for
from megatron.training.post_training_step import build_post_training_step
from megatron.training.preemption import Preemption, PreemptionConfig
from megatron.training.run_plan import RunPlan
from megatron.training.save_lock import SaveLock, acquire_on_rank0
from megatron.training.startup_signals import StartupSignals
from megatron.training.step import AccumulatingStep, BatchConfig, PipeStep, SequentialStep, StepResult, get_batch
from megatron.training.torch_compile import compile_transformer_layers, time_compiled_steps

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
    stopped_before_training: bool = False  # a signal came before the first step: nothing saved, STOPPED_EXIT_CODE


def checkpoint_args(values: dict[str, Any], tokenizer: Any, vocab_file: str | None) -> dict[str, Any]:
    """The model-shape values GPT-NeoX stores in every checkpoint and checks on load (``values`` holds at least
    ``ckpt.CHECKPOINT_ARG_KEYS``), plus the tokenizer's identity (``megatron.checkpoint.tokenizer_identity``)."""
    out = {k: values[k] for k in ckpt.CHECKPOINT_ARG_KEYS}
    if tokenizer is not None:
        out.update(tokenizer_identity(tokenizer, vocab_file))
    return out


@dataclass(frozen=True)
class ModelSetup:
    """What the model, optimizer, LR schedule and DeepSpeed engine are built from: the module configs, read once."""

    model: model_lib.GPTModelConfig
    optimizer_cfg: OptimizerConfig
    lr_schedule: LRScheduleConfig
    parallel: ParallelConfig
    activation_checkpointing_cfg: ActivationCheckpointConfig
    deepspeed_config: dict[str, Any]  # the DeepSpeed config from the DeepSpeed-section keys
    compile_layers: bool  # torch_compile
    checkpoint_args: dict[str, Any]  # stored in and checked against every checkpoint
    mup: MupConfig

    # bundles module configs and derived values: none of its fields is a config key itself
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = (
        "model",
        "optimizer_cfg",
        "lr_schedule",
        "parallel",
        "activation_checkpointing_cfg",
        "deepspeed_config",
        "compile_layers",
        "checkpoint_args",
        "mup",
    )

    @classmethod
    def from_neox_args(cls, args: NeoXArgs) -> ModelSetup:
        """The configs from the validated arguments (after the tokenizer set ``padded_vocab_size``)."""
        values = {k: getattr(args, k) for k in ckpt.CHECKPOINT_ARG_KEYS}
        layout = ParallelConfig.from_neox_args(args)  # the one reader of the ZeRO stage; the optimizer receives it
        return cls(
            model=with_prompt_init(model_lib.GPTModelConfig.from_neox_args(args), args.tokenizer),
            optimizer_cfg=OptimizerConfig.from_neox_args(args, layout),
            lr_schedule=LRScheduleConfig.from_neox_args(args),
            parallel=layout,
            activation_checkpointing_cfg=ActivationCheckpointConfig.from_neox_args(args),
            deepspeed_config=args.deepspeed_config,
            compile_layers=args.torch_compile,
            checkpoint_args=checkpoint_args(values, args.tokenizer, args.vocab_file),
            mup=MupConfig.from_neox_args(args),
        )


def build_model(cfg: model_lib.GPTModelConfig, plan: RunPlan) -> torch.nn.Module:
    """The GPT model for ``cfg``: a DeepSpeed PipelineModule (``plan.pipeline``) or the sequential model."""
    if plan.pipeline:
        return model_lib.build_pipeline_model(cfg)
    model = model_lib.build_sequential_model(cfg)
    return with_reward_head(model, cfg) if plan.reward_head else model


def setup_model_and_optimizer(
    setup: ModelSetup, plan: RunPlan, load_cfg: ckpt.CheckpointConfig, *, engine_steps_lr: bool = False
) -> tuple[Engine, AnnealingLR, int, Any]:
    """Model, optimizer, LR schedule, ``deepspeed.initialize`` and the optional load.

    The training step moves the LR schedule itself (``OptimizerStep.step_lr``), so DeepSpeed gets none; with
    ``engine_steps_lr`` (GPT-NeoX's API, whose callers drive ``engine.step()`` themselves) the engine is given the
    schedule and moves it, as in GPT-NeoX. Returns ``(engine, lr_scheduler, iteration, load_result)``.
    """
    opt_cfg, model_cfg = setup.optimizer_cfg, setup.model
    # The layout's rules (ZeRO-2/3 without the pipe engine; pipe activation partitioning off under SP).
    ds_config = setup.parallel.apply(deepspeed_config_for(setup.deepspeed_config, opt_cfg))
    apply_cpu_precision(ds_config)
    configure_activation_checkpointing(setup.activation_checkpointing_cfg)
    model = build_model(model_cfg, plan)  # the builders also register the sequence-parallel norm-gradient sync
    if setup.compile_layers:
        compile_transformer_layers(model)
    mup_shapes = prepare_mup(model, setup.mup, model_cfg, mpu.world_rank())  # None without use_mup
    optimizer, groups = build_optimizer(model, opt_cfg, mup_shapes)
    lr_scheduler = AnnealingLR(optimizer, setup.lr_schedule)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=groups if optimizer is None else None,
        lr_scheduler=lr_scheduler if engine_steps_lr else None,  # checkpoints save it either way
        config=ds_config,
        mpu=None if plan.pipeline else mpu,  # the pipe engine builds its own grid
        dist_init_required=False,
    )
    share_fp32_zero3_partitions(engine)  # fp32 ZeRO-3: the parameter partition is the master partition (no 2nd copy)
    skip_single_rank_allreduce(engine, mpu.get_data_parallel_world_size())  # 1 DP rank: nothing to reduce
    # DeepSpeed may wrap the optimizer (ZeRO, bf16): the schedule must write into the wrapper's groups.
    lr_scheduler.optimizer = engine.optimizer
    lr_scheduler.step(lr_scheduler.num_iters)
    prompt = soft_prompt_tokens(model_cfg) > 0  # may start from a checkpoint without the prefix (load checks the rest)
    result = ckpt.load_checkpoint(
        engine,
        lr_scheduler,
        load_cfg,
        checkpoint_args=setup.checkpoint_args,
        model=model_cfg,
        load_module_strict=not (plan.reward_head or prompt),
    )
    if result.path and plan.validate_with_forward:
        check_validation_logits(engine, plan, model_cfg.vocab_rows, result.client_state, result.path)
    return engine, lr_scheduler, result.iteration, result


def train_iters_from_epochs(data_cfg: DataConfig, train_epochs: int, gas: int) -> int:
    """GPT-NeoX's ``update_iterations``: ``train_iters = train_epochs × micro-batches per epoch // gas``."""
    data_cfg.validate()
    train_loader, _, _ = build_train_valid_test_data_loaders(
        data_cfg, dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size()
    )
    if train_loader is None:
        raise DataError("train_epochs needs training data")
    iters = train_epochs * len(train_loader) // gas
    if iters < 1:
        raise DataError(f"train_epochs {train_epochs}: the training data holds less than one global batch")
    logger.info("train_epochs %d: %d iterations", train_epochs, iters)
    return iters


VALIDATION_KEY = "checkpoint_validation_logits"


@torch.no_grad()
def validation_logits(engine: Engine, seq_length: int, vocab_size: int) -> torch.Tensor:
    """Logits of a fixed sequence (``checkpoint_validation_with_forward_pass``; sequential models only)."""
    tokens = (torch.arange(seq_length, device=engine.device) % vocab_size).unsqueeze(0)  # [1, s]
    was_training = engine.module.training
    engine.module.eval()
    logits = engine(tokens).float().cpu()
    engine.module.train(was_training)
    return logits


def check_validation_logits(
    engine: Engine, plan: RunPlan, vocab_size: int, client_state: dict[str, Any], path: str
) -> None:
    """Compare the stored forward pass with one of the loaded model (dtype-aware tolerance)."""
    stored = client_state.get(VALIDATION_KEY)
    if stored is None:
        logger.warning("checkpoint %s has no %s to validate against", path, VALIDATION_KEY)
        return
    current = validation_logits(engine, plan.seq_length, vocab_size)
    tol = 1e-5 if plan.params_dtype == torch.float32 else 2e-2
    if current.shape != stored.shape or not torch.allclose(current, stored.float(), atol=tol, rtol=tol):
        raise CheckpointError(f"checkpoint {path}: the loaded model does not reproduce the logits stored at save time")
    logger.info("checkpoint %s validated with a forward pass", path)


def build_step(
    plan: RunPlan,
    engine: Engine,
    lr_scheduler: AnnealingLR,
    timers: Timers,
    guard: StepGuard,
    batch_cfg: BatchConfig,
    post_cfg: PostTrainingConfig,
) -> PipeStep | AccumulatingStep:
    """The step variant the plan names (chosen once, here); ``guard`` is the non-finite / loss-spike skip decision
    of every step (``training/nonfinite.py``)."""
    if plan.step_variant == "post_training":
        gas = plan.gradient_accumulation_steps
        return build_post_training_step(post_cfg, engine, batch_cfg.eod_token, gas, timers, lr_scheduler, guard)
    if plan.step_variant == "pipe":
        assert isinstance(engine, DeepSpeedPipelineEngine)  # deepspeed.initialize of a PipelineModule (build_model)
        return PipeStep(engine, batch_cfg, timers, lr_scheduler, guard)
    loss_fn = with_aux_loss(model_lib.cross_entropy, engine.module)  # + the MoE load-balancing loss (if any)
    return SequentialStep(engine, loss_fn, batch_cfg, plan.gradient_accumulation_steps, timers, lr_scheduler, guard)


def build_data_iterators(
    data_cfg: DataConfig,
    post_cfg: PostTrainingConfig,
    consumed_train: int,
    consumed_valid: int,
    opened: dict[tuple[str, bool], Any] | None = None,
) -> tuple[Iterator[Any] | None, Iterator[Any] | None, Iterator[Any] | None]:
    """Endless train/valid/test batch iterators for this DP rank, resuming at the consumed sample counts
    (``opened``: the datasets :func:`check_datasets` opened before the model was built)."""
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    loaders = build_post_training_loaders(
        post_cfg,
        data_cfg,
        dp_rank=dp_rank,
        dp_size=dp_size,
        consumed_train=consumed_train,
        consumed_valid=consumed_valid,
    )
    if loaders is None:
        data_cfg.validate()
        loaders = build_train_valid_test_data_loaders(
            data_cfg,
            dp_rank=dp_rank,
            dp_size=dp_size,
            consumed_train_samples=consumed_train,
            consumed_valid_samples=consumed_valid,
            opened=opened,
        )
    train, valid, test = (iterate_forever(loader) if loader is not None else None for loader in loaders)
    return train, valid, test


def train_iters_for(train_iters: int | None, train_epochs: int | None, data_cfg: DataConfig, gas: int) -> int | None:
    """``train_iters`` as configured, or (unset, with ``train_epochs``) derived from the training data."""
    if train_iters is None and train_epochs:
        return train_iters_from_epochs(data_cfg, train_epochs, gas)
    return train_iters


def _log_summary(rank: int, observer: RunObserver, iteration: int) -> None:
    if rank == 0:
        logger.info(observer.summary_line(iteration))


def pretrain(
    args: NeoXArgs,
    startup: StartupSignals | None = None,
    on_step: Callable[[int, StepResult], None] | None = None,
) -> PretrainResult:
    """Train as configured; every rank calls this. Raises a ``UserError`` for configuration/data/checkpoint mistakes.

    ``startup``: the stop-signal handlers ``train.py`` installed first (a signal they recorded stops the run before its
    first step). ``on_step``: called with ``(iteration, StepResult)`` after every training step, on every rank (what
    GPT-NeoX's tests get by patching ``megatron.training.collect_loss_for_unit_test``)."""
    start_time = time.monotonic()
    timers = Timers()
    if startup is not None:
        startup.hold()  # from here on a signal is agreed on by all ranks, not acted on by one
    initialize_megatron(args)
    rank = mpu.world_rank()
    plan = RunPlan.from_neox_args(args)
    tokenizer = build_tokenizer(TokenizerConfig.from_neox_args(args))
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.model_parallel_size)
    iters = train_iters_for(
        args.train_iters, args.train_epochs, DataConfig.from_neox_args(args), plan.gradient_accumulation_steps
    )
    # the values known only now, in this run's copy of the arguments (the caller's stay as validated); the
    # tokenizer's identity goes into every checkpoint, as in GPT-NeoX
    args = args.derived(tokenizer=tokenizer, padded_vocab_size=vocab, train_iters=iters)
    post_cfg = PostTrainingConfig.from_neox_args(args)
    # bad data (a wrong path, a corrupt index, ids past the vocabulary) refused before the model and engine are built
    opened = None if builds_own_data(post_cfg) else check_datasets(DataConfig.from_neox_args(args))
    loop_cfg = LoopConfig.from_neox_args(args)
    log_cfg = LoggingConfig.from_neox_args(args)
    save_cfg = ckpt.CheckpointConfig.from_neox_args(args)
    resolved = args.to_dict()
    run_config = {k: v for k, v in resolved.items() if k != "config_files"}
    metrics = Metrics.create(
        log_cfg,
        rank=rank,
        local_rank=mpu.local_rank(),
        run_config=run_config,
        config_text=args.format_config(),
    )
    # one run per save folder (refused before anything is written there); its run id names the temporary folders
    save_lock = acquire_on_rank0(save_cfg.save) if save_cfg.save else SaveLock(None, "")
    preemption = Preemption(PreemptionConfig.from_neox_args(args)).install(startup)
    uploads: ckpt.S3Uploader | None = None
    online: OnlineSetup | None = None
    try:
        uploads = ckpt.start_uploads(save_cfg)  # rank 0's background S3 uploads (s3_path), else None
        setup = ModelSetup.from_neox_args(args)
        if setup.mup.use_mup and setup.mup.save_base_shapes:  # GPT-NeoX: write the base shapes and stop
            save_base_shapes(setup.mup, setup.model, lambda cfg: build_model(cfg, plan), rank, not plan.pipeline)
            return PretrainResult(iteration=0, start_iteration=0)
        engine, lr_scheduler, iteration, loaded = setup_model_and_optimizer(setup, plan, save_cfg)
        tbs = plan.train_batch_size
        consumed_valid = (loaded.consumed_valid_samples or 0) if loaded.path else 0
        if post_cfg.dataset_impl == "online":  # REINFORCE: rollouts from the data servers (and our weight server)
            online = setup_online(
                post_cfg, engine, seq_length=plan.seq_length, micro_batch_size=plan.train_micro_batch_size_per_gpu,
                vocab_size=vocab,
            )  # fmt: skip
            train_iter, valid_iter, test_iter = online.iterators
        else:
            train_iter, valid_iter, test_iter = build_data_iterators(
                DataConfig.from_neox_args(args), post_cfg, iteration * tbs, consumed_valid, opened
            )
        guard = build_step_guard(
            args.max_consecutive_nonfinite_steps,
            args.loss_spike_skip_window,
            args.loss_spike_skip_zscore,
            fp16=bool(engine.fp16_enabled()),
        )
        batch_cfg = BatchConfig.from_neox_args(args, tokenizer.eod)
        if setup.mup.use_mup and setup.mup.coord_check:  # GPT-NeoX: the coordinate check on the first batch, stop
            if train_iter is None:
                raise DataError("coord_check needs training data (data_path or train_data_paths)")
            run_coord_check(setup.model, setup.mup, get_batch(next(train_iter), batch_cfg), rank, Path.cwd())
            return PretrainResult(iteration=iteration, start_iteration=iteration)
        step = build_step(plan, engine, lr_scheduler, timers, guard, batch_cfg, post_cfg)
        if isinstance(step, SequentialStep | PipeStep):  # post-training objectives refuse it (config validation)
            step.curriculum = build_curriculum(CurriculumConfig.from_neox_args(args), iteration)
        if args.torch_compile:
            time_compiled_steps(step, loop_cfg.iterations - iteration)
        result = PretrainResult(
            iteration=iteration,
            start_iteration=iteration,
            optimizer_class=type(engine.optimizer).__name__,
            zero_stage=int(engine.zero_optimization_stage()),
            params_dtype=str(next(engine.module.parameters()).dtype).removeprefix("torch."),
        )

        def save(it: int) -> None:
            extra = {}
            if plan.validate_with_forward:
                extra[VALIDATION_KEY] = validation_logits(engine, plan.seq_length, vocab)
            ckpt.save_checkpoint(
                engine,
                lr_scheduler,
                it,
                save_cfg,
                checkpoint_args=setup.checkpoint_args,
                consumed_train_samples=it * tbs,
                consumed_valid_samples=trainer.consumed_valid,
                config_files=args.config_files or {},
                resolved_config=resolved,
                extra_state=extra,
                run_id=save_lock.run_id,
                uploads=uploads,
                model=setup.model,
            )
            result.saved.append(it)
            assert save_cfg.save is not None  # save() is the loop's save_fn only when save is set
            observer.saved(os.path.join(save_cfg.save, ckpt.checkpoint_tag(it)))

        observer = RunObserver(loop_cfg.iterations, tbs, plan.seq_length, iteration, start_time=start_time)
        trainer = Trainer(
            engine=engine,
            step=step,
            loop_cfg=loop_cfg,
            log_cfg=log_cfg,
            flops_cfg=flops_config_with_peak(FlopsConfig.from_neox_args(args), plan.params_dtype, rank),
            metrics=metrics,
            timers=timers,
            save_fn=save if save_cfg.save else None,
            is_save_iter=lambda it: ckpt.is_save_iter(it, save_cfg),
            profile_dir=log_cfg.log_dir or save_cfg.save or ".",
            task_eval=build_task_eval(engine, tokenizer, EvalConfig.from_neox_args(args)),
            char_counter=char_counter_factory(tokenizer, args.char_level_ppl),
            observer=observer,
            on_step=on_step,
        )
        trainer.consumed_valid = consumed_valid
        step.optimizer_step.stop_flag = preemption.local_flag  # reduced with the step's losses (no extra reduce)
        trainer.stop_check = lambda it, flag: preemption.stop_from(flag, it)
        if preemption.stop_before_training(iteration):  # one all-reduce: nothing trained, nothing to save
            result.stopped_before_training = True
            return result
        if save_cfg.save and iteration == 0 and 0 in (save_cfg.extra_save_iters or ()):
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
        if online is not None:
            online.close()
        preemption.uninstall()
        if uploads is not None:  # bounded by s3_flush_timeout, while the save folder is still this run's
            uploads.close()
        metrics.close()
        save_lock.release()
