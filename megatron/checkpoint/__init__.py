"""Checkpoint tools: read a GPT-NeoX/DeepSpeed checkpoint of any TP/PP layout, write any layout, convert to/from HF.

Public API:

* :func:`read_checkpoint` → :class:`NeoXCheckpoint` (full state dict in ``sequential.<idx>.`` names + config)
* :func:`write_checkpoint` (full state dict → DeepSpeed layout for a :class:`TargetLayout`)
* :func:`reshard_checkpoint` (any → any; ZeRO-0/1/2/3 and bf16-optimizer state come along in ZeRO-0 form)
* ``megatron.checkpoint.hf_io``: ``export_hf`` / ``import_hf`` (Hugging Face folders)
* ``megatron.checkpoint.autoreshard``: ``plan_load`` / ``plan_load_for_engine`` (resharding on load)
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
