"""3D-parallel training of a tiny GPT on spawned ranks, for the parity matrix (tests/distributed/test_parallel*.py).

Each layout is driven directly (not through the training loop): NeoX-style model config → mpu groups → sequential
model (``pipe_parallel_size: 0``) or ``GPT2ModelPipe`` (``>= 1``) → ``deepspeed.initialize`` → ``STEPS`` steps on
fixed data → eval loss → full weights in GPT-NeoX names gathered on rank 0. One call runs several variants in
the same processes (process start-up dominates the cost on 2 cores).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron import mpu

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 128, 32, 4, 2, 16
GLOBAL_BATCH, GAS, STEPS, SEED = 4, 2, 5, 1234

# Variants of the model/engine. "zero" 3 falls back to 1 under a pipeline (DeepSpeed refuses 2/3 there).
VARIANTS: dict[str, dict[str, Any]] = {
    # tied embeddings, ZeRO-1, rotary, sequential residual
    "tied-z1": {"tied": True, "zero": 1},
    # tied, ZeRO-0: a plain fp32 optimizer, clipped by megatron.training.grad_clipping (pipelines included)
    "tied-z0": {"tied": True, "zero": 0},
    # tied, ZeRO-3 (every parameter partitioned), parallel residual, checkpoint every layer
    "tied-z3-ckpt": {
        "tied": True,
        "zero": 3,
        "ckpt": 1,
        "model": {"gpt_j_residual": True, "pos_emb": "learned"},
    },
    # untied head, ZeRO-3, gated MLP (strided column shards)
    "untied-z3": {"tied": False, "zero": 3, "model": {"activation": "swiglu", "mlp_multiple_of": 8}},
    # untied, ZeRO-1, checkpoint 2 layers per chunk, partitioned + contiguous + CPU + synchronised checkpoints
    "untied-z1-ckpt-part": {
        "tied": False,
        "zero": 1,
        "ckpt": 2,
        "ckpt_opts": {
            "partition_activations": True,
            "contiguous_checkpointing": True,
            "checkpoint_in_cpu": True,
            "synchronize_each_layer": True,
        },
        "model": {"gpt_j_residual": True},
    },
    # Llama-style: GQA (blocked per-rank [q|k|v] shards), RMSNorm, SwiGLU, no linear biases
    "untied-z1-gqa-llama": {
        "tied": False,
        "zero": 1,
        "model": {
            "num_attention_heads": 8,
            "num_kv_heads": 4,
            "norm": "rmsnorm",
            "activation": "swiglu",
            "mlp_multiple_of": 8,
            "use_bias_in_attn_linear": False,
            "use_bias_in_mlp": False,
        },
    },
    # sequence parallelism (norm/dropout regions split on the sequence across the TP group), QK layernorm,
    # checkpoint every layer
    "tied-z1-sp-qk": {
        "tied": True,
        "zero": 1,
        "ckpt": 1,
        "model": {"sequence_parallel": True, "gpt_j_residual": True, "use_qk_layernorm": True},
    },
    # bf16 parameters and DeepSpeed bf16 (compared with a looser tolerance)
    "untied-bf16-z1": {"tied": False, "zero": 1, "bf16": True},
    # fp16 with dynamic loss scaling (DeepSpeed's fp16 check is overridden on CPUs without fp16 kernels)
    "tied-fp16-z1": {"tied": True, "zero": 1, "fp16": True},
    # GPT-NeoX's pipe_parallel_size: 1 (single-stage pipe engine) where the layout has one stage
    "tied-z1-pipe1": {"tied": True, "zero": 1, "pipe1": True},
}


def model_config(variant: dict[str, Any]) -> Any:
    """The tiny GPTModelConfig of a variant."""
    from megatron.model import GPTModelConfig

    kwargs: dict[str, Any] = {
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "padded_vocab_size": VOCAB,
        "max_position_embeddings": SEQ,
        "pos_emb": "rotary",
        "no_weight_tying": not variant["tied"],
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "checkpoint_activations": bool(variant.get("ckpt")),
        "checkpoint_num_layers": int(variant.get("ckpt") or 1),
        "seed": SEED,
    }
    if variant.get("bf16") or variant.get("fp16"):
        kwargs["params_dtype"] = torch.bfloat16 if variant.get("bf16") else torch.float16
    kwargs.update(variant.get("model", {}))
    return GPTModelConfig(**kwargs)


def ds_config(micro_batch: int, zero: int, bf16: bool = False, fp16: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of a run (fp32, clipping, AdamW).

    Adam's ``eps`` is 1e-6: some gradients are analytically zero (e.g. the key bias without rotary: softmax is
    invariant to it), so they are pure rounding noise, which ``eps=1e-8`` would blow up into lr-sized updates of
    random sign and make layouts incomparable.
    """
    zero_cfg: dict[str, Any] = {"stage": zero}
    if zero == 3:
        zero_cfg["stage3_param_persistence_threshold"] = 0  # partition even tiny params (catches missed gathers)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "eps": 1e-6, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero_cfg,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": fp16, "loss_scale": 0, "initial_scale_power": 12},
    }


def _sequences(step: int) -> torch.Tensor:
    """The GLOBAL_BATCH training sequences of a step (step -1: the evaluation batch); [B, SEQ+1].

    Arithmetic progressions modulo VOCAB - 1 (learnable, so the loss falls and gradients matter).
    """
    gen = torch.Generator().manual_seed(7919 * (step + 2))
    start = torch.randint(0, VOCAB - 1, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % (VOCAB - 1)


def _micro_batches(step: int, micro_batch: int) -> Iterator[dict[str, torch.Tensor] | None]:
    """This DP rank's GAS micro-batches of ``step`` (None on TP ranks > 0, which receive a broadcast)."""
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    data = _sequences(step)
    for micro in range(GAS):
        start = (micro * dp + dp_rank) * micro_batch
        yield {"text": data[start : start + micro_batch]} if mpu.get_model_parallel_rank() == 0 else None


def _batch(data: dict[str, torch.Tensor] | None) -> tuple:
    """GPT-NeoX's ``((tokens, position_ids, attention_mask), (labels, loss_mask))`` (TP rank 0 broadcasts)."""
    from megatron.training.step import BatchConfig, get_batch

    return get_batch(data, BatchConfig(eod_token=VOCAB - 1))


def _mean_over_dp(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=mpu.get_data_parallel_group())
    return t.item() / mpu.get_data_parallel_world_size()


def _to_numpy(state: dict[str, torch.Tensor] | None) -> dict[str, np.ndarray] | None:
    return None if state is None else {k: v.numpy() for k, v in state.items()}


def build_engine(
    variant: dict[str, Any], pipe: bool, micro_batch: int, zero: int, ds_extra: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """Model + ``deepspeed.initialize`` for the current mpu layout (``ds_extra``: more DeepSpeed config keys);
    returns ``(engine, cfg)``."""
    import deepspeed

    from megatron.model import build_pipeline_model, build_sequential_model
    from megatron.model.activation_checkpointing import ActivationCheckpointConfig, configure_activation_checkpointing
    from megatron.parallel_config import ParallelConfig

    pipe_size = mpu.get_pipe_parallel_world_size() if pipe else 0
    cfg = model_config(variant)
    mpu.model_parallel_cuda_manual_seed(SEED)
    # what pretrain()'s model setup does: DeepSpeed's checkpoint storage is set once, outside the model builders
    configure_activation_checkpointing(
        ActivationCheckpointConfig(
            checkpoint_activations=cfg.checkpoint_activations,
            checkpoint_num_layers=cfg.checkpoint_num_layers,
            num_layers=LAYERS,
            pipe_parallel_size=pipe_size,
            gradient_accumulation_steps=GAS,
            sequence_parallel=cfg.sequence_parallel,
            **variant.get("ckpt_opts", {}),
        )
    )
    model = build_pipeline_model(cfg) if pipe else build_sequential_model(cfg)
    layout = ParallelConfig(
        model_parallel_size=mpu.get_model_parallel_world_size(),
        pipe_parallel_size=pipe_size,
        sequence_parallel=cfg.sequence_parallel,
        zero_stage=zero,
    )
    if variant.get("fp16"):
        # DeepSpeed refuses fp16 on CPUs without native fp16 kernels; it runs (emulated, slowly) when allowed.
        from megatron.training.deepspeed_adapter import allow_fp16_on_cpu

        allow_fp16_on_cpu()
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=layout.apply(
            {**ds_config(micro_batch, zero, bool(variant.get("bf16")), bool(variant.get("fp16"))), **(ds_extra or {})}
        ),
        mpu=None if pipe else mpu,
        dist_init_required=False,
    )
    _attach_optimizer_step(engine, pipe)  # what the training step does: its clipping, skip decision and step
    return engine, cfg


_OPTIMIZER_STEPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _attach_optimizer_step(engine: Any, pipe: bool) -> None:
    """The training step's ``OptimizerStep`` for ``engine`` (run by the pipeline schedule under ``pipe``)."""
    from megatron.training.deepspeed_adapter import run_optimizer_step_through
    from megatron.training.nonfinite import build_step_guard
    from megatron.training.step import OptimizerStep, PipelineOptimizerStep

    step_cls = PipelineOptimizerStep if pipe else OptimizerStep
    opt_step = step_cls(engine, build_step_guard(10, fp16=engine.fp16_enabled()), None)  # constant LR
    if pipe:
        run_optimizer_step_through(engine, opt_step)
    _OPTIMIZER_STEPS[engine] = opt_step


def train_steps(
    engine: Any, pipe: bool, micro_batch: int, first_step: int, steps: int, grad_norms: list[float] | None = None
) -> list[float]:
    """Run optimizer steps ``first_step ..``; returns the global-batch mean loss of each (and the gradient norm
    before clipping of each, appended to ``grad_norms``)."""
    from megatron.model import cross_entropy

    losses = []
    for step in range(first_step, first_step + steps):
        if pipe:
            batches = (_batch(d) for d in _micro_batches(step, micro_batch))
            loss = float(engine.train_batch(data_iter=batches))
            # the loss the step read in its one decision at DeepSpeed's optimizer step is DeepSpeed's own aggregate,
            # bit for bit (dp <= 2 in every layout here: the sums agree exactly; see tests/e2e/test_train_pipe_loss.py)
            decided = _OPTIMIZER_STEPS[engine].last.lm_loss
            if decided != loss and not (math.isnan(decided) and math.isnan(loss)):
                raise AssertionError(
                    f"step {step}: the step decided on loss {decided!r}, train_batch returned {loss!r}"
                )
            losses.append(loss)
        else:
            total = 0.0
            micro_losses = []
            for data in _micro_batches(step, micro_batch):
                inputs, targets = _batch(data)
                loss = cross_entropy(engine(inputs), targets)
                engine.backward(loss)
                micro_losses.append(loss.detach().reshape(1))
                if not engine.is_gradient_accumulation_boundary():
                    engine.step()
                total += loss.item() / GAS
            opt_step = _OPTIMIZER_STEPS[engine]
            opt_step.clip_gradients()
            assert opt_step.decide(torch.cat(micro_losses)).apply
            engine.step()
            losses.append(_mean_over_dp(total))
        if grad_norms is not None:
            grad_norms.append(_OPTIMIZER_STEPS[engine].global_grad_norm())
    return losses


def eval_loss(engine: Any, pipe: bool, micro_batch: int) -> float:
    """Loss of the held-out batch (``eval_batch`` for pipelines)."""
    from megatron.model import cross_entropy

    if pipe:
        batches = (_batch(d) for d in _micro_batches(-1, micro_batch))
        return float(engine.eval_batch(data_iter=batches))
    engine.eval()
    total = 0.0
    with torch.no_grad():
        for data in _micro_batches(-1, micro_batch):
            inputs, targets = _batch(data)
            total += cross_entropy(engine(inputs), targets).item() / GAS
    engine.train()
    return _mean_over_dp(total)


def run_variant(variant: dict[str, Any], pipe_stages: int, steps: int = STEPS) -> dict[str, Any]:
    """Train one variant in the current layout; weights/initial weights only on rank 0."""
    from megatron.model.full_weights import gather_full_state_dict

    pipe = pipe_stages > 1 or bool(variant.get("pipe1"))
    zero = variant["zero"] if not (pipe and variant["zero"] >= 2) else 1
    micro_batch = GLOBAL_BATCH // (GAS * mpu.get_data_parallel_world_size())
    started = time.perf_counter()
    engine, cfg = build_engine(variant, pipe, micro_batch, zero)
    init = gather_full_state_dict(engine, cfg)
    norms: list[float] = []
    losses = train_steps(engine, pipe, micro_batch, 0, steps, norms)
    evaluated = eval_loss(engine, pipe, micro_batch)
    final = gather_full_state_dict(engine, cfg)
    return {
        "losses": losses,
        "grad_norms": norms,
        "eval": evaluated,
        "zero": int(engine.zero_optimization_stage()),
        "engine": type(engine).__name__,
        "optimizer": type(engine.optimizer).__name__,
        "seconds": time.perf_counter() - started,
        "init": _to_numpy(init),
        "final": _to_numpy(final),
    }


def partitions(methods: list[str]) -> dict[str, list[int]]:
    """Stage boundaries (``PipelineModule.parts``) of the tiny model for each ``pipe_partition_method``."""
    from megatron.model import build_pipeline_model

    cfg = model_config(VARIANTS["tied-z1"])
    return {m: [int(b) for b in build_pipeline_model(cfg.replace(pipe_partition_method=m)).parts] for m in methods}


def run_layout(
    tp: int,
    pp: int,
    variants: list[str | tuple[str, dict]],
    steps: int = STEPS,
    partition_methods: list[str] | None = None,
    resume_dir: str | None = None,
) -> dict[str, Any]:
    """All ``variants`` under tensor-parallel size ``tp`` and ``pp`` pipeline stages (dp = world / (tp·pp)).

    ``pp == 1`` runs the sequential model (``pipe_parallel_size: 0``) unless a variant asks for the single-stage
    pipe engine; ``partition_methods`` also reports the stage boundaries of each method; ``resume_dir`` also
    runs :func:`fns_parallel_resume.save_and_resume` with a ZeRO-3 (ZeRO-1 under a pipeline) dropout variant.
    A variant is a name in ``VARIANTS`` or a ``(name, spec)`` pair. Returns ``{variant: result}`` (weights only
    on rank 0) plus the layout seen by this rank.
    """
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tp, pp)
    out: dict[str, Any] = {
        "layout": (
            mpu.get_model_parallel_world_size(),
            mpu.get_pipe_parallel_world_size(),
            mpu.get_data_parallel_world_size(),
        ),
        "coord": (mpu.get_pipe_parallel_rank(), mpu.get_data_parallel_rank(), mpu.get_model_parallel_rank()),
    }
    if partition_methods:
        out["partitions"] = partitions(partition_methods)
    for item in variants:
        name, spec = (item, VARIANTS[item]) if isinstance(item, str) else item
        out[name] = run_variant(spec, pp, steps)
    if resume_dir:
        from tests.distributed import fns_parallel_resume

        out["resume"] = fns_parallel_resume.save_and_resume(tp, pp, resume_dir, fns_parallel_resume.MATRIX_VARIANT)
    mpu.destroy_model_parallel()
    return out


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Largest absolute difference over two state dicts with the same keys and shapes."""
    if sorted(a) != sorted(b):
        raise AssertionError(f"different tensor names: {sorted(set(a) ^ set(b))}")
    worst = 0.0
    for key in a:
        if a[key].shape != b[key].shape:
            raise AssertionError(f"{key}: shape {a[key].shape} != {b[key].shape}")
        if not a[key].size:
            continue
        diff = float(np.max(np.abs(a[key].astype(np.float64) - b[key].astype(np.float64))))
        if not math.isfinite(diff):  # NaN/inf anywhere: max(0.0, nan) would be 0.0 and pass every tolerance
            return float("inf")
        worst = max(worst, diff)
    return worst
