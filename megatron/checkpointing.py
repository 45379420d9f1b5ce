"""GPT-NeoX's ``megatron.checkpointing``: ``save_checkpoint`` / ``load_checkpoint`` with its signatures (the
implementation lives in ``megatron.training.checkpointing``; see ``megatron.training.gpt_neox_api``)."""

from megatron.training.gpt_neox_api import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
