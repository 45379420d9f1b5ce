"""The config keys lm-eval evaluation reads (``eval.py`` and ``eval_tasks`` during training)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config_utils import NeoXValues, from_schema, neox_values, schema_defaults


@dataclass(kw_only=True)  # the required keys have no default
@schema_defaults
class EvalConfig:
    """What the evaluation adapter and lm-eval's ``simple_evaluate`` need (GPT-NeoX key names)."""

    eval_tasks: list | None = from_schema()
    eval_limit: int | None = from_schema()
    eval_bootstrap_iters: int = from_schema()
    eval_num_fewshot: int | None = from_schema()  # GPT-NeoX: every task 0-shot; None: each task's own
    seed: int = from_schema()
    seq_length: int
    max_position_embeddings: int
    train_micro_batch_size_per_gpu: int
    pipe_parallel_size: int = from_schema()

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> EvalConfig:
        """Read every field strictly under its NeoX key (values as set, ``None`` included)."""
        return cls(**neox_values(cls, args))

    @property
    def max_length(self) -> int:
        """The longest request in tokens: ``max_position_embeddings``."""
        return self.max_position_embeddings

    @property
    def micro_batch_size(self) -> int:
        """Requests scored per forward."""
        return self.train_micro_batch_size_per_gpu
