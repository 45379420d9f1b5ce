"""Checkpoint tools: read a GPT-NeoX/DeepSpeed checkpoint of any TP/PP layout, write any layout, convert to/from HF.

Public API:

* :func:`read_checkpoint` → :class:`NeoXCheckpoint` (full state dict in ``sequential.<idx>.`` names + config)
* :func:`write_checkpoint` (full state dict → DeepSpeed layout for a :class:`TargetLayout`)
* :func:`reshard_checkpoint` (any → any, with ZeRO-0 optimizer state)
* :func:`export_hf` / :func:`import_hf` (Hugging Face folders)
* :func:`detect_layout`, :func:`resolve_checkpoint_dir`, :class:`CheckpointError`
"""

from megatron.checkpoint.layout import CheckpointError, CheckpointLayout, detect_layout, resolve_checkpoint_dir
from megatron.checkpoint.reader import NeoXCheckpoint, read_checkpoint
from megatron.checkpoint.reshard import ReshardResult, reshard_checkpoint
from megatron.checkpoint.writer import TargetLayout, write_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointLayout",
    "NeoXCheckpoint",
    "ReshardResult",
    "TargetLayout",
    "detect_layout",
    "read_checkpoint",
    "reshard_checkpoint",
    "resolve_checkpoint_dir",
    "write_checkpoint",
]
