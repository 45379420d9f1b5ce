"""The optimizer types of ``optimizer.type``: one ``OPTIMIZERS.register`` entry each.

An entry carries what every consumer needs: the factory (``megatron.training.optimizers.build_optimizer`` calls
it with the param groups), the optimizer-state floats per parameter (the planner's memory model), and the ZeRO
stages DeepSpeed has tested it under (others need ``zero_allow_untested_optimizer``). Adding an optimizer: one
``OPTIMIZERS.register`` call below, its name in ``OptimizerType`` (megatron/neox_arguments/sections/optimizer.py;
``tests/unit/test_registries.py`` fails until both agree) and a test.

| type | implementation |
|---|---|
| ``adam`` | ``torch.optim.AdamW`` (decoupled weight decay, what GPT-NeoX's FusedAdam computes; torch's fused one-pass kernel for CPU parameters); ``params.fused: true`` or ``params.torch_adam: false`` selects DeepSpeed's ``FusedAdam`` (JIT-built C++ op on CPU, ~70 s once) |
| ``cpu_adam`` / ``cpu_torch_adam`` | ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (JIT-built once), for ZeRO-Offload |
| ``onebitadam`` | created by DeepSpeed from the config (needs a CUDA/NCCL backend) |
| ``sgd`` | ``torch.optim.SGD`` (GPT-NeoX builds MuSGD, which works only with muP; with ``use_mup`` ours gets MuSGD's groups) |
| ``lion`` / ``sm3`` / ``madgrad_wd`` | ``megatron.training.optim_algorithms`` (Lion → DeepSpeed ``FusedLion`` under ZeRO on accelerators, as GPT-NeoX) |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron.neox_arguments.errors import ConfigError
from megatron.registry import Registry
from megatron.training.bnb_optimizer import adam8bit
from megatron.training.optim_algorithms import MADGRAD, SM3, Lion
from megatron.training.optimizer_config import OptimizerConfig

ALL_STAGES = frozenset({0, 1, 2, 3})
STAGE_0 = frozenset({0})

# (param groups, lr, the remaining optimizer.params, the config) -> the optimizer; None: DeepSpeed builds it
Factory = Callable[[list[dict[str, Any]], float, dict[str, Any], OptimizerConfig], "torch.optim.Optimizer | None"]


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer type."""

    factory: Factory
    state_floats: int
    """fp32 optimizer-state values kept per parameter (Adam: exp_avg and exp_avg_sq = 2)."""
    zero_stages: frozenset[int] = STAGE_0
    """ZeRO stages DeepSpeed has tested it under (deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS)."""
    cpu_zero_stages: frozenset[int] | None = None
    """``zero_stages`` when the ranks run on CPU (None: the same)."""
    deepspeed_type: str | None = None
    """DeepSpeed builds this optimizer itself from its config's ``optimizer: {type: deepspeed_type}`` (the factory
    returns None)."""

    def tested_stages(self, on_cpu: bool) -> frozenset[int]:
        """The ZeRO stages that run without ``zero_allow_untested_optimizer`` on this machine."""
        return self.cpu_zero_stages if on_cpu and self.cpu_zero_stages is not None else self.zero_stages


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer.type")
CPU_ADAM_TYPES = ("cpu_adam", "cpu_torch_adam")  # DeepSpeedCPUAdam: what ZeRO-Offload takes without forcing


def _adam(groups: list[dict[str, Any]], lr: float, params: dict[str, Any], cfg: OptimizerConfig) -> Any:
    fused = bool(params.pop("fused", False))
    fused = params.pop("torch_adam", True) is False or fused
    betas = tuple(params.pop("betas", (0.9, 0.999)))
    eps = float(params.pop("eps", 1e-8))
    if cfg.use_bnb_optimizer:  # GPT-NeoX's use_bnb_optimizer: bitsandbytes' 8-bit Adam
        return adam8bit(groups, lr=lr, betas=betas, eps=eps, **params)
    if fused:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True, **params)
    params.pop("adam_w_mode", None)
    if "foreach" not in params and all(p.device.type == "cpu" for g in groups for p in g["params"]):
        params.setdefault("fused", True)  # torch's one-pass CPU kernel: same update, about 2x faster than the loop
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **params)


def _cpu_adam(groups: list[dict[str, Any]], lr: float, params: dict[str, Any], cfg: OptimizerConfig) -> Any:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, lr=lr, **params)


def _onebitadam(groups: list[dict[str, Any]], lr: float, params: dict[str, Any], cfg: OptimizerConfig) -> None:
    if cfg.on_cpu:
        raise ConfigError(
            "optimizer.type onebitadam needs DeepSpeed's NCCL/MPI compressed backend; it does not run on CPU"
        )
    return None  # DeepSpeed builds it from its config (see deepspeed_config_for)


def _lion(groups: list[dict[str, Any]], lr: float, params: dict[str, Any], cfg: OptimizerConfig) -> Any:
    if cfg.layout_zero_stage > 0 and not cfg.on_cpu:
        from deepspeed.ops.lion import FusedLion

        return FusedLion(groups, lr=lr, **params)
    return Lion(groups, lr=lr, **params)


OPTIMIZERS.register("adam", OptimizerSpec(_adam, state_floats=2, zero_stages=ALL_STAGES))
OPTIMIZERS.register(
    "onebitadam", OptimizerSpec(_onebitadam, state_floats=2, zero_stages=ALL_STAGES, deepspeed_type="OneBitAdam")
)
OPTIMIZERS.register("cpu_adam", OptimizerSpec(_cpu_adam, state_floats=2, zero_stages=ALL_STAGES))
OPTIMIZERS.register("cpu_torch_adam", OptimizerSpec(_cpu_adam, state_floats=2, zero_stages=ALL_STAGES))
OPTIMIZERS.register("sm3", OptimizerSpec(lambda g, lr, p, c: SM3(g, lr=lr, **p), state_floats=1))
OPTIMIZERS.register("madgrad_wd", OptimizerSpec(lambda g, lr, p, c: MADGRAD(g, lr=lr, **p), state_floats=3))
OPTIMIZERS.register("sgd", OptimizerSpec(lambda g, lr, p, c: torch.optim.SGD(g, lr=lr, **p), state_floats=1))
# Under ZeRO on accelerators Lion is DeepSpeed's FusedLion (tested); on CPU it is ours, which DeepSpeed has not tested.
OPTIMIZERS.register("lion", OptimizerSpec(_lion, state_floats=1, zero_stages=ALL_STAGES, cpu_zero_stages=STAGE_0))
