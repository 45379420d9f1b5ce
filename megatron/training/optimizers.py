"""Optimizer construction from GPT-NeoX's ``optimizer: {type, params}`` and ``weight_decay`` keys.

Param groups follow GPT-NeoX: norms, biases and params flagged ``_no_weight_decay`` get ``weight_decay = 0``
(the rule, shared with the checkpoint resharder, is ``megatron.model.weight_decay``); frozen params are left out.
The types and their implementations are the entries of ``megatron.training.optimizer_registry.OPTIMIZERS``.

DeepSpeed refuses optimizers it has not tested under ZeRO unless ``zero_allow_untested_optimizer`` is set; that
rule is checked here first (from the registry entry's ZeRO stages), so the error names the key.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron.model.mup import MupShapes
from megatron.model.weight_decay import no_weight_decay
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.zero_offload import OFFLOAD_DEVICES
from megatron.training.optimizer_config import OptimizerConfig
from megatron.training.optimizer_registry import CPU_ADAM_TYPES, OPTIMIZERS

logger = logging.getLogger(__name__)


def weight_decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable params into a decayed group and a ``weight_decay: 0.0`` group (norms, biases, flagged)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))  # tied weights appear under several modules
            (no_decay if no_weight_decay(module, name, param) else decay).append(param)
    if weight_decay == 0:
        return [{"params": decay + no_decay, "weight_decay": 0.0}]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def prompt_free_stage(model: torch.nn.Module) -> bool:
    """A pipeline stage of a prompt-tuned model without the prefix: nothing of it trains, and that is right (the
    optimizer gets an empty group; the stage still runs its part of every step)."""
    from megatron.model.soft_prompt import SoftPromptPipe, soft_prompt_tokens

    cfg = getattr(model, "cfg", None)
    return (
        getattr(model, "num_stages", 1) > 1
        and cfg is not None
        and soft_prompt_tokens(cfg) > 0
        and not any(isinstance(m, SoftPromptPipe) for m in model.modules())
    )


def check_zero_compatibility(cfg: OptimizerConfig) -> None:
    """Raise a clear error where DeepSpeed would assert on an optimizer it has not tested under ZeRO, or refuse a
    client optimizer under ZeRO-Offload."""
    offloaded = cfg.offload_device in OFFLOAD_DEVICES  # DeepSpeed checks this at any ZeRO stage
    if offloaded and cfg.type not in CPU_ADAM_TYPES and cfg.force_ds_cpu_optimizer:
        raise ConfigError(
            f"zero_optimization.offload_optimizer device {cfg.offload_device!r} steps the optimizer on the CPU, "
            f"which DeepSpeed does with its own CPU Adam only: set optimizer.type to cpu_adam (not "
            f"{(cfg.optimizer or {}).get('type', cfg.type)!r}), or deepspeed_extra_args "
            "{zero_force_ds_cpu_optimizer: false} to step this optimizer on the CPU anyway"
        )
    tested = OPTIMIZERS.get(cfg.type).tested_stages(cfg.on_cpu)
    if cfg.layout_zero_stage > 0 and cfg.layout_zero_stage not in tested and not cfg.zero_allow_untested_optimizer:
        usable = [name for name, spec in OPTIMIZERS.items() if cfg.layout_zero_stage in spec.tested_stages(cfg.on_cpu)]
        raise ConfigError(
            f"optimizer.type {(cfg.optimizer or {}).get('type', cfg.type)!r} is not tested by DeepSpeed under ZeRO "
            f"stage {cfg.layout_zero_stage}; set zero_allow_untested_optimizer: true to use it anyway, or use one of "
            f"{', '.join(usable)}"
        )


def build_optimizer(
    model: torch.nn.Module, cfg: OptimizerConfig, mup: MupShapes | None = None
) -> tuple[torch.optim.Optimizer | None, list[dict[str, Any]]]:
    """Build the optimizer for ``model``; returns ``(optimizer, param_groups)``.

    ``optimizer`` is None where DeepSpeed builds it from its config and the param groups (``onebitadam``).
    ``mup``: the model's muP shapes (``megatron.model.mup.apply_mup``), which split the groups by LR multiplier.
    """
    if cfg.type not in OPTIMIZERS:
        raise ConfigError(OPTIMIZERS.unknown((cfg.optimizer or {}).get("type", cfg.type)))
    spec = OPTIMIZERS.get(cfg.type)
    check_zero_compatibility(cfg)
    params = cfg.params
    if "weight_decay" in params:
        raise ConfigError("put weight_decay at the top level of the config, not in optimizer.params (as GPT-NeoX)")
    groups = weight_decay_param_groups(model, cfg.weight_decay)
    if not groups and prompt_free_stage(model):
        groups = [{"params": [], "weight_decay": 0.0}]
    if not any(g["params"] for g in groups) and not prompt_free_stage(model):
        raise ConfigError("the model has no trainable parameters")
    params.pop("lr", None)  # the config layer derives the key lr from it (its one default lives there)
    if mup is not None:
        groups = mup.param_groups(groups, cfg.type, cfg.lr)
    return spec.factory(groups, cfg.lr, params, cfg), groups


def deepspeed_config_for(ds_config: dict[str, Any], cfg: OptimizerConfig) -> dict[str, Any]:
    """The DeepSpeed JSON for ``deepspeed.initialize``: we build the optimizer and scheduler ourselves.

    DeepSpeed refuses an optimizer both in the config and from the client, so ``optimizer`` is dropped unless
    DeepSpeed is to build it (a registry entry with ``deepspeed_type``: onebitadam); ``scheduler`` is dropped
    because our AnnealingLR is the scheduler.
    """
    out = dict(ds_config)
    out.pop("scheduler", None)
    deepspeed_type = OPTIMIZERS.get(cfg.type).deepspeed_type
    if deepspeed_type is not None:
        out["optimizer"] = {"type": deepspeed_type, "params": cfg.params}
    else:
        out.pop("optimizer", None)
    if cfg.zero_allow_untested_optimizer or cfg.use_bnb_optimizer:
        # bitsandbytes' 8-bit Adam is not on DeepSpeed's list of ZeRO-tested optimizers; ZeRO steps it on the flat
        # fp32 partitions like any other (configs/bnb_125M.yml, fp16 with a pipeline, runs ZeRO-1: PIPE_FP16_ZERO_NOTE)
        out["zero_allow_untested_optimizer"] = True
    return out
