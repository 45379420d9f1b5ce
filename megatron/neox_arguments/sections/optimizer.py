"""Optimizer, learning-rate schedule and mixture-of-experts keys."""

# `arg()` returns a dataclasses.field (with the key's docstring); ruff cannot see that.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from megatron.neox_arguments.fields import arg

LR_DECAY_STYLES = Literal["constant", "linear", "cosine", "exponential", "inverse_sqrt"]
MOE_ROUTER_TYPES = Literal["sinkhorn", "topk"]
# Exactly the entries of megatron/training/optimizer_registry.py's OPTIMIZERS (checked by tests/unit/test_registries.py).
OptimizerType = Literal["adam", "onebitadam", "cpu_adam", "cpu_torch_adam", "sm3", "madgrad_wd", "sgd", "lion"]
OPTIMIZER_TYPES: tuple[str, ...] = get_args(OptimizerType)


@dataclass(kw_only=True)
class OptimizerTypeKeys:
    """Which optimizer runs."""

    optimizer_type: OptimizerType = arg(
        "adam", "Optimizer, taken from `optimizer.type` (case-insensitive).", derived=True
    )
    use_bnb_optimizer: bool = arg(False, "Use bitsandbytes 8-bit Adam and a stable embedding.")


@dataclass(kw_only=True)
class ZeroKeys:
    """The ZeRO values mirrored from ``zero_optimization``."""

    zero_stage: int = arg(0, "ZeRO stage, mirrored from `zero_optimization.stage`.", derived=True)
    zero_reduce_scatter: bool = arg(
        None, "ZeRO: reduce-scatter gradients instead of all-reduce (mirrored).", derived=True
    )
    zero_contiguous_gradients: bool = arg(
        None, "ZeRO: copy gradients into one contiguous buffer (mirrored).", derived=True
    )
    zero_reduce_bucket_size: int = arg(None, "ZeRO: elements reduced at a time (mirrored).", derived=True)
    zero_allgather_bucket_size: int = arg(None, "ZeRO: elements all-gathered at a time (mirrored).", derived=True)


@dataclass(kw_only=True)
class LRKeys:
    """The peak learning rate."""

    lr: float = arg(0.001, "Peak learning rate, taken from `optimizer.params.lr` when that is set.", derived=True)


@dataclass(kw_only=True)
class OptimizerArgs(OptimizerTypeKeys, ZeroKeys, LRKeys):
    """Optimizer choice and the ZeRO values mirrored from ``zero_optimization``."""


@dataclass(kw_only=True)
class LRSchedulerArgs:
    """Learning-rate warmup and decay."""

    lr_decay_style: LR_DECAY_STYLES = arg(
        "linear", "Shape of the decay after warmup (inverse_sqrt, ours: lr_max·sqrt(max(W,1) / n) after warmup)."
    )
    lr_decay_iters: int | None = arg(None, "Iterations over which the learning rate decays (default train_iters).")
    lr_decay_fraction: float | None = arg(
        None, "Decay over floor(train_iters · lr_decay_fraction) iterations; used only when lr_decay_iters is unset."
    )
    min_lr: float = arg(0.0, "Floor of the learning rate; the schedule is clipped below it.")
    warmup: float = arg(0.01, "Warmup length as a fraction of the decay iterations (0.01 = 1%).")
    override_lr_scheduler: bool = arg(
        False, "On resume, take the schedule from this config and ignore the checkpoint's schedule."
    )
    use_checkpoint_lr_scheduler: bool = arg(
        False, "On resume, take the schedule from the checkpoint and ignore this config's."
    )


@dataclass(kw_only=True)
class MoEArgs:
    """Dropless mixture-of-experts layers (GPT-NeoX's megablocks keys; neox-forge's own implementation, see
    docs/moe.md). Experts are sharded over the tensor-parallel group."""

    moe_num_experts: int = arg(
        1,
        "Experts per MoE layer; 1 means dense MLPs. Must be divisible by model_parallel_size (expert parallelism "
        "over the TP group). MoE runs with pipe_parallel_size 0 or 1 and ZeRO stage 0 or 1.",
    )
    moe_expert_interval: int = arg(
        1, "Layer i (0-based) is an MoE layer when i % moe_expert_interval == 0 (GPT-NeoX's placement)."
    )
    moe_top_k: int = arg(1, "Experts each token is routed to (1..moe_num_experts); no token is ever dropped.")
    moe_router_type: MOE_ROUTER_TYPES = arg(
        "sinkhorn",
        "Routing algorithm. topk: softmax router, the top-k probabilities weight the experts. sinkhorn: in training "
        "the experts are chosen on Sinkhorn-balanced scores and weighted by sigmoid (k=1) / softmax (k>1) of the "
        "logits; in evaluation plain top-k of those.",
    )
    moe_lbl_in_fp32: bool = arg(False, "Compute the router probabilities of the load-balancing loss in fp32.")
    moe_jitter_eps: float | None = arg(
        None, "topk router only: multiply router inputs by uniform noise in [1-eps, 1+eps] during training."
    )
    moe_normalize_expert_weights: bool = arg(
        False,
        "neox-forge key, topk router only: divide each token's top-k weights by their sum (Mixtral's routing; "
        "needed for export to MixtralForCausalLM). False: GPT-NeoX's unnormalised top-k probabilities.",
    )
    moe_gated_experts: bool = arg(
        False,
        "neox-forge key, gated activations (swiglu, geglu, reglu, glu, bilinear) only: experts are gated MLPs, "
        "w1 (gate), w3 (up) and w2 of width int(8h/3) rounded up to 256 (Mixtral's expert; needed for export to "
        "MixtralForCausalLM). False: GPT-NeoX's expert, w1/w2 of width 4h rounded up to 256 with the activation's "
        "function (e.g. SiLU for swiglu) applied ungated, so checkpoints interchange with GPT-NeoX.",
    )
    moe_loss_weight: float = arg(
        0.0,
        "neox-forge key: weight of the load-balancing loss E·Σ_e f_e·P_e (mean over MoE layers) added to the "
        "training loss. 0 (default) trains like GPT-NeoX, which adds no auxiliary loss; ~0.01 is usual with topk.",
    )
