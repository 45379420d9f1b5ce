"""Every place where neox-forge relies on DeepSpeed internals, each checked against DeepSpeed 0.19.8.

DeepSpeed's public API covers most of a training step (``engine.backward``, ``engine.step``,
``engine.is_gradient_accumulation_boundary``, ``engine.get_global_grad_norm``, ``engine.was_step_applied``); what it
does not offer is collected here, one function per item, so that the step itself (``megatron/training/step.py``)
reads top to bottom and a DeepSpeed upgrade has exactly one file to review. ``tests/unit/test_deepspeed_adapter.py``
holds a test per item that fails when DeepSpeed changes what the item relies on, and
``CHECKED_DEEPSPEED`` must equal the installed version (raising it means re-running those tests and re-reading the
DeepSpeed code each comment names). Nothing here patches a DeepSpeed class: every adaptation is made on one engine,
optimizer or accelerator instance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from megatron.engine_protocol import Engine, PipelineEngine

logger = logging.getLogger("megatron.train")

CHECKED_DEEPSPEED = "0.19.8"  # the version every item below was read against


# 1. Where the reduced gradients are before the optimizer step (read only). DeepSpeed 0.19.8: a plain optimizer keeps
#    them in ``param.grad``; ZeRO-1/2/3 in ``optimizer.averaged_gradients`` (dict: group -> list of partitions);
#    the BF16 optimizer in ``optimizer.fp32_groups_gradients_flat``.
def reduced_gradients(engine: Engine) -> list[torch.Tensor]:
    """This rank's gradients as the optimizer will read them (non-empty tensors): the wrapper's own buffers where
    it has them, else the parameters' ``.grad``."""
    opt = engine.optimizer
    out: list[torch.Tensor] = []
    for group in (getattr(opt, "averaged_gradients", None) or {}).values():
        out.extend(g for g in group or [] if torch.is_tensor(g))
    out.extend(g for g in getattr(opt, "fp32_groups_gradients_flat", None) or [] if torch.is_tensor(g))
    if not out:
        out = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return [g for g in out if g.numel()]


# 2. fp16 without ZeRO. DeepSpeed 0.19.8's ``engine.backward`` scales the loss only for ZeRO optimizers
#    (``optimizer.scale_if_loss``), while its FP16 optimizer for ZeRO-0 unscales the gradients in ``step()``
#    all the same; the scale it divides by is ``optimizer.loss_scale_config.cur_scale``.
def manual_loss_scale(engine: Engine) -> Any:
    """The factor the step must multiply the loss by before ``engine.backward`` (None: DeepSpeed scales, or no
    fp16)."""
    opt = engine.optimizer
    if not engine.fp16_enabled() or isinstance(opt, ZeROOptimizer) or not hasattr(opt, "loss_scale_config"):
        return None
    return opt.loss_scale_config.cur_scale  # as DeepSpeed holds it (no host read)


# 3. fp32 clipping. DeepSpeed 0.19.8's ``_take_model_step`` clips a plain fp32 optimizer's gradients through
#    ``engine.clip_fp32_gradients()`` with ``clip_grad_norm_(mpu=engine.mpu)``, whose norm leaves out the replicated
#    parameters of every pipeline stage after the first and is not recorded (``get_global_grad_norm`` stays None).
#    The step clips those gradients itself (grad_clipping.py), so the engine's own call is made a no-op, on this
#    engine only.
def engine_clips_fp32(engine: Engine) -> bool:
    """True when DeepSpeed's ``_take_model_step`` would clip through ``clip_fp32_gradients`` (its own condition)."""
    wrapped = engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()
    return engine.gradient_clipping() > 0.0 and not wrapped


def leave_fp32_clipping_to_the_step(engine: Engine) -> None:
    """Make this engine's ``clip_fp32_gradients`` a no-op (the step has clipped already)."""
    engine.clip_fp32_gradients = _no_clipping


def _no_clipping() -> None:
    return None


# 4. A skipped optimizer step. DeepSpeed 0.19.8 skips a step only for an fp16 overflow, inside ``_take_model_step``:
#    the optimizer drops the gradients, ``skipped_steps`` grows, ``_step_applied`` is False, ``losses`` is reset,
#    the LR schedule does not move, and ``global_steps`` / ``global_samples`` advance as for an applied step;
#    ``engine.step()`` then counts the micro-step (``micro_steps``). A skip decided by neox-forge does the same.
def skip_optimizer_step(engine: Engine, count_micro_step: bool) -> None:
    """Forget this step's gradients and count a skipped step as DeepSpeed counts an fp16 overflow;
    ``count_micro_step``: the caller does not call ``engine.step()`` for this micro-batch (the sequential step)."""
    opt = engine.optimizer
    try:
        opt.zero_grad(set_to_none=True)
    except TypeError:  # DeepSpeed's fp16 optimizers take no set_to_none
        opt.zero_grad()
    if isinstance(getattr(opt, "averaged_gradients", None), dict):
        opt.averaged_gradients = {}  # ZeRO: the reduced partitions would otherwise be added to next step's
    for name in ("clear_hp_grads", "clear_lp_grads"):  # BF16 optimizer: its fp32 gradient buffers
        if callable(getattr(opt, name, None)):
            getattr(opt, name)()
    engine.module.zero_grad(set_to_none=True)
    engine.skipped_steps += 1
    engine._step_applied = False
    engine.losses = None
    engine.global_steps += 1
    engine.global_samples += engine.train_batch_size()
    if count_micro_step:
        engine.micro_steps += 1


# 5. The pipeline engine's optimizer step. DeepSpeed 0.19.8's ``PipelineEngine.train_batch`` runs forward, backward
#    and the optimizer step inside its schedule; the ``OptimizerStep`` instruction calls ``self._take_model_step``
#    (looked up on the instance). The step's decision is run there, on this engine only.
def run_optimizer_step_through(engine: PipelineEngine, optimizer_step: Callable[[Callable[[], None]], object]) -> None:
    """Make the pipeline schedule's optimizer step call ``optimizer_step(apply)``; ``apply()`` is DeepSpeed's step
    (clipping of wrapped optimizers, ``optimizer.step()``, ``zero_grad`` and the counters; the engine has no LR
    schedule: ``optimizer_step`` moves the LR after ``apply``)."""
    original = engine._take_model_step

    def take_model_step(lr_kwargs: Any = None) -> None:
        optimizer_step(lambda: original(lr_kwargs))

    engine._take_model_step = take_model_step


# 6. One data-parallel rank. DeepSpeed 0.19.8's ZeRO-0 engine all-reduces the gradients after every boundary backward
#    while ``enable_backward_allreduce`` is True, even with one data-parallel rank (a flatten, a self all-reduce,
#    a scale and a copy back: three passes for nothing). With one DP rank, fp32 and a plain optimizer it is switched
#    off (the flag is read in ``_backward_epilogue``).
def skip_single_rank_allreduce(engine: Engine, dp_world_size: int) -> bool:
    """Turn off the engine's backward all-reduce when it can only copy; returns whether it did."""
    plain_optimizer = isinstance(getattr(engine, "optimizer", None), torch.optim.Optimizer)
    stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else -1
    pipe = bool(getattr(engine, "pipeline_parallelism", False))
    moe = bool(getattr(engine, "has_moe_layers", False))
    if dp_world_size != 1 or stage != 0 or pipe or moe or not plain_optimizer:
        return False
    if not getattr(engine, "enable_backward_allreduce", False):
        return False
    engine.enable_backward_allreduce = False
    logger.debug("one data-parallel rank: DeepSpeed's backward gradient all-reduce skipped")
    return True


# 7. fp32 ZeRO-3 without a second fp32 copy. DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer_Stage3``
#    ``_create_fp32_partitions`` means to reuse a parameter partition that already has the master dtype and the
#    optimizer's device as the master partition, but compares ``partition.device`` (a torch.device) with
#    ``self.device`` (a string), so it always copies. After the engine is built, each such copy is replaced by the
#    partition itself in ``fp32_partitioned_groups_flat``, in the inner optimizer's param groups and in its state
#    (the optimizer then steps the partition in place, and DeepSpeed's copy back after the step copies a tensor
#    onto itself). Offload (its own branch) and other dtypes keep their copy.
def share_fp32_zero3_partitions(engine: Engine) -> int:
    """Drop the duplicate fp32 master partitions of a ZeRO-3 optimizer; returns how many were shared."""
    opt = engine.optimizer
    lp = getattr(opt, "fp16_partitioned_groups_flat", None)
    hp = getattr(opt, "fp32_partitioned_groups_flat", None)
    if engine.zero_optimization_stage() != 3 or lp is None or hp is None or getattr(opt, "offload_optimizer", True):
        return 0
    inner = opt.optimizer
    shared = 0
    for i, (low, high) in enumerate(zip(lp, hp, strict=True)):
        if low is None or low is high or low.dtype != high.dtype or low.device != high.device:
            continue
        if low.shape != high.shape or getattr(opt, "_swappable_optimizer_subgroup", lambda _: True)(i):
            continue
        low.data.copy_(high.data)  # equal already; the master values win
        low.requires_grad = True
        low.ds_id = getattr(high, "ds_id", None)
        for group in inner.param_groups:
            group["params"] = [low if p is high else p for p in group["params"]]
        if high in inner.state:
            inner.state[low] = inner.state.pop(high)
        hp[i] = low
        shared += 1
    if shared:
        logger.debug("fp32 ZeRO-3: %d parameter partitions double as master partitions", shared)
    return shared


# 8. fp16 on a CPU. DeepSpeed 0.19.8's CPU accelerator answers ``is_fp16_supported() -> False`` and the engine then
#    refuses an fp16 config; the answer is overridden on the accelerator object of this process (no class patch).
def allow_fp16_on_cpu() -> None:
    """Let DeepSpeed build fp16 engines on the CPU accelerator (emulated fp16)."""
    get_accelerator().is_fp16_supported = _supported


def _supported() -> bool:
    return True


# 9. The pipeline's loss at its optimizer step (read only). DeepSpeed 0.19.8's ``PipelineEngine.train_batch`` sets
#    ``total_loss = None`` before running ``TrainSchedule``; on the last stage ``_exec_forward_pass`` adds each
#    micro-batch's detached loss into ``total_loss`` (a sum, in the loss's dtype), and the schedule's ``OptimizerStep``
#    is its last instruction, after every forward pass. After the schedule, ``_aggregate_total_loss`` returns
#    ``total_loss / gradient_accumulation_steps()`` summed over the data-parallel group and divided by its size,
#    broadcast from the last stage over the pipe group: train_batch's return value. At the optimizer step the sum of
#    the iteration's ``gas`` losses is therefore already there, so the step's one reduction can carry it.
def pipeline_loss_sum(engine: PipelineEngine) -> torch.Tensor | None:
    """On the last pipeline stage, the sum of this iteration's micro-batch losses (complete at the schedule's
    optimizer step), shape ``[1]``; None on the other stages, which compute no loss."""
    if not engine.is_last_stage():
        return None
    total = engine.total_loss
    if not torch.is_tensor(total) or total.numel() != 1:
        raise ValueError(
            f"the pipeline's loss at its optimizer step is {type(total).__name__}, not a scalar tensor: the model's "
            "loss_fn must return one scalar loss"
        )
    return total.detach().reshape(1)


# 10. A parameter's optimizer state under ZeRO-1/2 and the BF16 optimizer (read only). DeepSpeed 0.19.8 keeps it in the
#    torch optimizer's state of the flat fp32 partition ``single_partition_of_fp32_groups[g]`` (ZeRO) or
#    ``fp32_groups_flat_partition[g]`` (BF16); the parameter's slice of that partition on this rank is
#    ``param._hp_mapping.hp_fragment_address`` (``None`` mapping: no slice here). ``safe_get_full_optimizer_state``
#    reads the same slice through ``optim_fragment``, which DeepSpeed fills only when a step links it.
def optimizer_state_fragment(engine: Engine, param: torch.Tensor, key: str) -> torch.Tensor | None:
    """This rank's slice of ``param``'s optimizer state ``key`` (the slices of all data-parallel ranks are
    disjoint), an empty tensor where this rank holds none, or ``None`` where the optimizer keeps no flat partition."""
    opt = engine.optimizer
    flats = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_groups_flat_partition", None)
    if not flats or not hasattr(param, "_hp_mapping"):
        return None
    mapping = param._hp_mapping
    if mapping is None:
        return torch.zeros(0)
    state = opt.optimizer.state.get(flats[mapping.param_group_index], {})
    value = state.get(key)
    if not torch.is_tensor(value):
        return torch.zeros(0)
    address = mapping.hp_fragment_address
    return value.narrow(0, address.start, address.numel)
