"""``OptimizerConfig``: the optimizer's keys, read by the optimizer builder (``optimizers.py``) and by the
registry's factories (``optimizer_registry.py``), which both import it from here (no import cycle between them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from megatron.config_utils import NeoXValues, neox_values
from megatron.distributed import on_cpu
from megatron.neox_arguments.nested_checks import NUMERIC_PARAMS
from megatron.neox_arguments.sections.deepspeed import OptimizerDictKeys
from megatron.neox_arguments.sections.optimizer import LRKeys, OptimizerTypeKeys
from megatron.neox_arguments.sections.training import UpdateRuleKeys
from megatron.neox_arguments.zero_offload import offload_device
from megatron.parallel_config import ParallelConfig


@dataclass
class OptimizerConfig(OptimizerDictKeys, OptimizerTypeKeys, LRKeys, UpdateRuleKeys):
    """GPT-NeoX keys for the optimizer."""

    zero_allow_untested_optimizer: bool = False
    on_cpu: bool = True
    layout_zero_stage: int = 0
    """The ZeRO stage, received from its owner (``ParallelConfig.zero_stage``), not read from the arguments."""
    offload_device: str = "none"
    """``zero_optimization.offload_optimizer.device`` (cpu or nvme: ZeRO-Offload steps the optimizer on the CPU)."""
    force_ds_cpu_optimizer: bool = True
    """DeepSpeed's ``zero_force_ds_cpu_optimizer`` (deepspeed_extra_args): ZeRO-Offload only with its CPU Adam."""

    # not config keys: DeepSpeed's own settings (read from the DeepSpeed config), the machine, the layout's stage
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = (
        "zero_allow_untested_optimizer",
        "on_cpu",
        "layout_zero_stage",
        "offload_device",
        "force_ds_cpu_optimizer",
    )

    @classmethod
    def from_neox_args(cls, args: NeoXValues, layout: ParallelConfig) -> OptimizerConfig:
        """Read every field strictly under its NeoX key (``zero_allow_untested_optimizer``: deepspeed_extra_args);
        the ZeRO stage comes from the run's ``layout``."""
        extra = args.deepspeed_extra_args or {}
        allow = extra.get("zero_allow_untested_optimizer", False)  # DeepSpeed-only keys
        return cls(
            **neox_values(cls, args),
            zero_allow_untested_optimizer=bool(allow),
            on_cpu=on_cpu(),
            layout_zero_stage=layout.zero_stage,
            offload_device=offload_device(args.zero_optimization, "offload_optimizer"),
            force_ds_cpu_optimizer=extra.get("zero_force_ds_cpu_optimizer", True) is not False,
        )

    @property
    def type(self) -> str:
        """The lower-cased optimizer type: ``optimizer.type``, else ``optimizer_type`` (the config layer sets both)."""
        return str((self.optimizer or {}).get("type", self.optimizer_type)).lower()

    @property
    def params(self) -> dict[str, Any]:
        """A copy of ``optimizer.params`` (none when the ``optimizer`` section is unset), numbers written as strings
        (``eps: '1e-8'``) converted to floats (the config layer checked that they are numbers: nested_checks.py)."""
        params = dict((self.optimizer or {}).get("params") or {})
        return {k: float(v) if k in NUMERIC_PARAMS and isinstance(v, str) else v for k, v in params.items()}
