"""A run's checkpoint keys (:class:`CheckpointConfig`), the save schedule and the model-shape args a checkpoint
stores."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.checkpoint.layout import CheckpointError
from megatron.config_utils import NeoXValues, neox_overrides
from megatron.neox_arguments.keys import CHECKPOINTED_KEYS
from megatron.neox_arguments.sections.deepspeed import UniversalCheckpointKeys
from megatron.neox_arguments.sections.model import ResidualKeys
from megatron.neox_arguments.sections.other import LoadIterationKeys
from megatron.neox_arguments.sections.training import CheckpointKeys, LoadSaveKeys, S3Keys

# GPT-NeoX's model-shape args a checkpoint stores: marked next to each key in the schema (``checkpointed=True``)
CHECKPOINT_ARG_KEYS = CHECKPOINTED_KEYS
AUTO = "auto"


@dataclass
class CheckpointConfig(LoadSaveKeys, CheckpointKeys, S3Keys, LoadIterationKeys, ResidualKeys, UniversalCheckpointKeys):
    """GPT-NeoX checkpoint keys (``gpt_j_residual`` decides how row-parallel biases are stored at TP > 1:
    ``checkpoint.bias_layout``; ``load_universal``: ``checkpoint.universal``)."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> CheckpointConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        values = neox_overrides(cls, args)
        values["extra_save_iters"] = [int(i) for i in values.get("extra_save_iters", [])]
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError for inconsistent keys."""
        if self.checkpoint_scale not in ("linear", "log"):
            raise CheckpointError(f"checkpoint_scale must be 'linear' or 'log', got {self.checkpoint_scale!r}")
        if self.checkpoint_factor is not None:
            if self.checkpoint_scale == "linear" and (
                float(self.checkpoint_factor) != int(self.checkpoint_factor) or int(self.checkpoint_factor) < 1
            ):
                raise CheckpointError(
                    f"checkpoint_factor must be a positive integer with linear scale, got {self.checkpoint_factor}"
                )
            if self.checkpoint_scale == "log" and float(self.checkpoint_factor) <= 1:
                raise CheckpointError(f"checkpoint_factor must be > 1 with log scale, got {self.checkpoint_factor}")
        if self.save and self.checkpoint_factor is None and not self.extra_save_iters:
            raise CheckpointError("save is set but neither checkpoint_factor nor extra_save_iters says when to save")
        if self.load_universal and not self.load:
            raise CheckpointError(
                "load_universal is set but load is not: set load to the folder holding latest_universal "
                "(tools/ckpts/convert_to_universal.py writes it)"
            )
        if self.keep_last_n_checkpoints is not None and self.keep_last_n_checkpoints < 1:
            raise CheckpointError(f"keep_last_n_checkpoints must be >= 1, got {self.keep_last_n_checkpoints}")


def is_save_iter(iteration: int, cfg: CheckpointConfig) -> bool:
    """True when ``iteration`` is in ``extra_save_iters`` or on the ``checkpoint_factor`` schedule."""
    if iteration in (cfg.extra_save_iters or ()):
        return True
    if cfg.checkpoint_factor is None or iteration <= 0:
        return False
    if cfg.checkpoint_scale == "linear":
        return iteration % int(cfg.checkpoint_factor) == 0
    power = 1.0
    while int(power) <= iteration:  # log scale: iteration == int(factor ** k) for some k >= 0
        if int(power) == iteration:
            return True
        power *= float(cfg.checkpoint_factor)
    return False
