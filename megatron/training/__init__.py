"""Training: the loop, step variants, optimizers and LR schedules (checkpoints: ``megatron.checkpoint``).

GPT-NeoX's ``megatron/training.py`` names (``pretrain``, ``setup_model_and_optimizer``) are read from here, as in
``from megatron.training import setup_model_and_optimizer``. They are resolved on first use: the run composition
imports DeepSpeed, the model and the data pipeline, which importing a light submodule (``learning_rates``, ...)
must not pay for.
"""

from __future__ import annotations

from typing import Any

_GPT_NEOX_NAMES = ("pretrain", "setup_model_and_optimizer")


def __getattr__(name: str) -> Any:
    if name in _GPT_NEOX_NAMES:
        from megatron.training import gpt_neox_api

        return getattr(gpt_neox_api, name)
    if name == "collect_loss_for_unit_test":
        raise AttributeError(
            "megatron.training.collect_loss_for_unit_test: GPT-NeoX's test hook is not in neox-forge's training loop; "
            "pass on_step=callback to megatron.training.pretraining.pretrain() (docs/gpt-neox-differences.md)"
        )
    raise AttributeError(f"module 'megatron.training' has no attribute {name!r}")
