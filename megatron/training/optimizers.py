"""Optimizer construction from GPT-NeoX's ``optimizer: {type, params}`` and ``weight_decay`` keys.

Param groups follow GPT-NeoX: norms, biases and params flagged ``_no_weight_decay`` get ``weight_decay = 0``;
frozen params are left out. Types (case-insensitive):

| type | implementation |
|---|---|
| ``adam`` | ``torch.optim.AdamW`` (decoupled weight decay, what GPT-NeoX's FusedAdam computes; torch's fused one-pass kernel for CPU parameters); ``params.fused: true`` or ``params.torch_adam: false`` selects DeepSpeed's ``FusedAdam`` (JIT-built C++ op on CPU, ~70 s once) |
| ``cpu_adam`` / ``cpu_torch_adam`` | ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (JIT-built once), for ZeRO-Offload |
| ``onebitadam`` | created by DeepSpeed from the config (needs a CUDA/NCCL backend) |
| ``sgd`` | ``torch.optim.SGD`` (GPT-NeoX requires muP's MuSGD; muP is not supported here) |
| ``lion`` / ``sm3`` / ``madgrad_wd`` | ``megatron.training.optim_algorithms`` (Lion → DeepSpeed ``FusedLion`` under ZeRO on accelerators, as GPT-NeoX) |

DeepSpeed refuses optimizers it has not tested under ZeRO unless ``zero_allow_untested_optimizer`` is set; that
rule is checked here first, so the error names the key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from megatron.config_utils import NeoXValues, from_schema, schema_defaults
from megatron.distributed import on_cpu
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.sections.optimizer import OPTIMIZER_TYPES, OptimizerType
from megatron.training.optim_algorithms import MADGRAD, SM3, Lion

logger = logging.getLogger(__name__)

NORM_CLASS_NAMES = {
    "LayerNorm",
    "RMSNorm",
    "ScaleNorm",
    "TELayerNorm",
    "TERMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "NonParametricLayerNorm",
}
# Optimizers DeepSpeed itself knows to be safe under ZeRO (deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS).
_ZERO_TESTED = ("adam", "cpu_adam", "cpu_torch_adam", "onebitadam", "lion")


@dataclass
@schema_defaults
class OptimizerConfig:
    """GPT-NeoX keys for the optimizer."""

    optimizer: dict | None = from_schema()
    optimizer_type: OptimizerType = from_schema()
    weight_decay: float = from_schema()
    zero_stage: int = from_schema()
    zero_allow_untested_optimizer: bool = False
    use_mup: bool = from_schema()
    on_cpu: bool = True

    # not config keys: DeepSpeed's own setting (read from the DeepSpeed config) and the machine
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("zero_allow_untested_optimizer", "on_cpu")

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> OptimizerConfig:
        """Read every field strictly under its NeoX key (``zero_allow_untested_optimizer``: deepspeed_extra_args)."""
        allow = (args.deepspeed_extra_args or {}).get("zero_allow_untested_optimizer", False)  # a DeepSpeed-only key
        return cls(
            optimizer=args.optimizer,
            optimizer_type=args.optimizer_type,
            weight_decay=args.weight_decay,
            zero_stage=args.zero_stage,
            zero_allow_untested_optimizer=bool(allow),
            use_mup=args.use_mup,
            on_cpu=on_cpu(),
        )

    @property
    def type(self) -> str:
        """The lower-cased optimizer type: ``optimizer.type``, else ``optimizer_type`` (the config layer sets both)."""
        return str((self.optimizer or {}).get("type", self.optimizer_type)).lower()

    @property
    def params(self) -> dict[str, Any]:
        """A copy of ``optimizer.params`` (none when the ``optimizer`` section is unset)."""
        return dict((self.optimizer or {}).get("params") or {})


def _is_norm(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name in NORM_CLASS_NAMES or name.lower().endswith("norm")


def weight_decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable params into a decayed group and a ``weight_decay: 0.0`` group (norms, biases, flagged)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        norm = _is_norm(module)
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))  # tied weights appear under several modules
            if norm or name == "bias" or name.endswith(".bias") or getattr(param, "_no_weight_decay", False):
                no_decay.append(param)
            else:
                decay.append(param)
    if weight_decay == 0:
        return [{"params": decay + no_decay, "weight_decay": 0.0}]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def check_zero_compatibility(cfg: OptimizerConfig) -> None:
    """Raise a clear error where DeepSpeed would assert on an optimizer it has not tested under ZeRO."""
    # Under ZeRO, Lion is DeepSpeed's FusedLion on accelerators; on CPU it is ours (no JIT build), thus untested.
    tested = [t for t in _ZERO_TESTED if not (t == "lion" and cfg.on_cpu)]
    if cfg.zero_stage > 0 and cfg.type not in tested and not cfg.zero_allow_untested_optimizer:
        raise ConfigError(
            f"optimizer.type {(cfg.optimizer or {}).get('type', cfg.type)!r} is not tested by DeepSpeed under ZeRO stage "
            f"{cfg.zero_stage}; set zero_allow_untested_optimizer: true to use it anyway, or use Adam/Lion"
        )


def build_optimizer(
    model: torch.nn.Module, cfg: OptimizerConfig
) -> tuple[torch.optim.Optimizer | None, list[dict[str, Any]]]:
    """Build the optimizer for ``model``; returns ``(optimizer, param_groups)``.

    ``optimizer`` is None for ``onebitadam``: DeepSpeed builds it from its config and the param groups.
    """
    kind = cfg.type
    if kind not in OPTIMIZER_TYPES:
        raise ConfigError(
            f"optimizer.type {(cfg.optimizer or {}).get('type', cfg.type)!r} is not one of {', '.join(OPTIMIZER_TYPES)}"
        )
    if cfg.use_mup:
        raise ConfigError("use_mup is not supported by neox-forge; unset it")
    check_zero_compatibility(cfg)
    params = cfg.params
    if "weight_decay" in params:
        raise ConfigError("put weight_decay at the top level of the config, not in optimizer.params (as GPT-NeoX)")
    groups = weight_decay_param_groups(model, cfg.weight_decay)
    if not groups:
        raise ConfigError("the model has no trainable parameters")
    lr = float(params.pop("lr", 0.001))
    if kind == "adam":
        fused = bool(params.pop("fused", False))
        fused = params.pop("torch_adam", True) is False or fused
        betas = tuple(params.pop("betas", (0.9, 0.999)))
        eps = float(params.pop("eps", 1e-8))
        if fused:
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True, **params), groups
        params.pop("adam_w_mode", None)
        if "foreach" not in params and all(p.device.type == "cpu" for g in groups for p in g["params"]):
            params.setdefault("fused", True)  # torch's one-pass CPU kernel: same update, about 2x faster than the loop
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **params), groups
    if kind in ("cpu_adam", "cpu_torch_adam"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, **params), groups
    if kind == "onebitadam":
        if cfg.on_cpu:
            raise ConfigError(
                "optimizer.type onebitadam needs DeepSpeed's NCCL/MPI compressed backend; it does not run on CPU"
            )
        return None, groups
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, **params), groups
    if kind == "lion":
        if cfg.zero_stage > 0 and not cfg.on_cpu:
            from deepspeed.ops.lion import FusedLion

            return FusedLion(groups, lr=lr, **params), groups
        return Lion(groups, lr=lr, **params), groups
    if kind == "sm3":
        return SM3(groups, lr=lr, **params), groups
    return MADGRAD(groups, lr=lr, **params), groups  # madgrad_wd


def deepspeed_config_for(ds_config: dict[str, Any], cfg: OptimizerConfig) -> dict[str, Any]:
    """The DeepSpeed JSON for ``deepspeed.initialize``: we build the optimizer and scheduler ourselves.

    DeepSpeed refuses an optimizer both in the config and from the client, so ``optimizer`` is dropped unless
    DeepSpeed is to build it (onebitadam); ``scheduler`` is dropped because our AnnealingLR is the scheduler.
    """
    out = dict(ds_config)
    out.pop("scheduler", None)
    if cfg.type == "onebitadam":
        out["optimizer"] = {"type": "OneBitAdam", "params": cfg.params}
    else:
        out.pop("optimizer", None)
    if cfg.zero_allow_untested_optimizer:
        out["zero_allow_untested_optimizer"] = True
    return out
