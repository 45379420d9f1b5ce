"""GPT-NeoX's import path ``megatron.checkpointing``, kept for GPT-NeoX users and tests: a thin re-export of
``save_checkpoint`` / ``load_checkpoint`` with GPT-NeoX's signatures from ``megatron.training.gpt_neox_api``, and
nothing else (``tests/unit/test_checkpoint_entry.py``). The checkpoint code itself is the package
``megatron.checkpoint``."""

from megatron.training.gpt_neox_api import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
