"""``OptimizerConfig``: the optimizer's keys, read by the optimizer builder (``optimizers.py``) and by the
registry's factories (``optimizer_registry.py``), which both import it from here (no import cycle between them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from megatron.config_utils import NeoXValues, from_schema, schema_defaults
from megatron.distributed import on_cpu
from megatron.neox_arguments.nested_checks import NUMERIC_PARAMS
from megatron.neox_arguments.sections.optimizer import OptimizerType
from megatron.parallel_config import ParallelConfig


@dataclass
@schema_defaults
class OptimizerConfig:
    """GPT-NeoX keys for the optimizer."""

    optimizer: dict | None = from_schema()
    optimizer_type: OptimizerType = from_schema()
    lr: float = from_schema()  # optimizer.params.lr, derived into lr by the config layer
    weight_decay: float = from_schema()
    zero_allow_untested_optimizer: bool = False
    on_cpu: bool = True
    layout_zero_stage: int = 0
    """The ZeRO stage, received from its owner (``ParallelConfig.zero_stage``), not read from the arguments."""

    # not config keys: DeepSpeed's own setting (read from the DeepSpeed config), the machine, the layout's stage
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("zero_allow_untested_optimizer", "on_cpu", "layout_zero_stage")

    @classmethod
    def from_neox_args(cls, args: NeoXValues, layout: ParallelConfig) -> OptimizerConfig:
        """Read every field strictly under its NeoX key (``zero_allow_untested_optimizer``: deepspeed_extra_args);
        the ZeRO stage comes from the run's ``layout``."""
        allow = (args.deepspeed_extra_args or {}).get("zero_allow_untested_optimizer", False)  # a DeepSpeed-only key
        return cls(
            optimizer=args.optimizer,
            optimizer_type=args.optimizer_type,
            lr=args.lr,
            weight_decay=args.weight_decay,
            zero_allow_untested_optimizer=bool(allow),
            on_cpu=on_cpu(),
            layout_zero_stage=layout.zero_stage,
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
