"""Checks of the mixture-of-experts keys (run by config validation and ``GPTModelConfig``; each problem names the key
and valid values). Plain Python: deepy validates configs without importing torch models or DeepSpeed."""

from __future__ import annotations

from typing import Any

from megatron.neox_arguments.sections.model import GATED_ACTIVATIONS

ROUTER_TYPES = ("sinkhorn", "topk")


def moe_problems(cfg: Any) -> list[str]:
    """Every problem of the ``moe_*`` keys of ``cfg`` (a ``GPTModelConfig`` or any object with GPT-NeoX's flat
    attribute names); empty when valid or when the model is dense."""
    problems: list[str] = []
    if not isinstance(cfg.moe_num_experts, int) or cfg.moe_num_experts < 1:
        return [f"moe_num_experts={cfg.moe_num_experts!r} must be an int >= 1 (1 = dense MLPs)"]
    if cfg.moe_gated_experts:
        if cfg.moe_num_experts == 1:
            problems.append("moe_gated_experts applies to MoE models only (moe_num_experts > 1)")
        elif cfg.activation not in GATED_ACTIVATIONS:
            problems.append(
                f"moe_gated_experts needs a gated activation ({', '.join(GATED_ACTIVATIONS)}), got {cfg.activation!r}"
            )
    if cfg.moe_num_experts == 1:
        return problems
    if not isinstance(cfg.moe_expert_interval, int) or cfg.moe_expert_interval < 1:
        problems.append(f"moe_expert_interval={cfg.moe_expert_interval!r} must be an int >= 1")
    if not isinstance(cfg.moe_top_k, int) or not 1 <= cfg.moe_top_k <= cfg.moe_num_experts:
        problems.append(f"moe_top_k={cfg.moe_top_k!r} must be an int in [1, moe_num_experts={cfg.moe_num_experts}]")
    if str(cfg.moe_router_type).lower() not in ROUTER_TYPES:
        problems.append(f"moe_router_type={cfg.moe_router_type!r} is not one of {', '.join(ROUTER_TYPES)}")
    eps = cfg.moe_jitter_eps
    if eps is not None and not 0.0 <= eps < 1.0:
        problems.append(f"moe_jitter_eps={eps!r} must be in [0, 1) (or null for no jitter)")
    if eps and str(cfg.moe_router_type).lower() == "sinkhorn":
        problems.append(
            "moe_jitter_eps applies to moe_router_type: topk only (GPT-NeoX's sinkhorn router has no jitter)"
        )
    if cfg.moe_normalize_expert_weights and str(cfg.moe_router_type).lower() != "topk":
        problems.append("moe_normalize_expert_weights applies to moe_router_type: topk only")
    if cfg.moe_loss_weight is None or not cfg.moe_loss_weight >= 0.0:
        problems.append(f"moe_loss_weight={cfg.moe_loss_weight!r} must be >= 0")
    if cfg.sequence_parallel:
        problems.append(
            "moe_num_experts > 1 cannot be combined with sequence_parallel: true (the experts need every token of "
            "the tensor-parallel group); set sequence_parallel: false"
        )
    return problems


def moe_layout_problems(v: dict[str, Any]) -> list[str]:
    """What an MoE model cannot be combined with (resolved config values ``v``)."""
    experts = v.get("moe_num_experts")
    if not isinstance(experts, int) or experts <= 1:
        return []
    out = []
    tp = v.get("model_parallel_size") or 1
    if experts % tp:
        out.append(
            f"moe_num_experts={experts} must be divisible by model_parallel_size={tp} (experts are sharded over "
            "the tensor-parallel group)"
        )
    if (v.get("pipe_parallel_size") or 0) > 1:
        out.append(
            f"not supported yet: moe_num_experts={experts} with pipe_parallel_size={v['pipe_parallel_size']} "
            "(MoE layers run with pipe_parallel_size 0 or 1); use tensor/data parallelism for MoE models"
        )
    stage = v.get("zero_stage")
    if isinstance(stage, int) and stage >= 2:
        out.append(f"moe_num_experts={experts} needs ZeRO stage 0 or 1 (GPT-NeoX's rule), got stage {stage}")
    impl = v.get("train_impl")
    if impl not in (None, "normal"):
        out.append(f"not supported yet: moe_num_experts={experts} with train_impl {impl} (MoE trains with normal)")
    return out
