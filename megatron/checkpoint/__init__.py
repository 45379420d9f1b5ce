"""Checkpoints: a training run's save and load, and the tools that read any GPT-NeoX/DeepSpeed checkpoint layout,
write any layout and convert to/from Hugging Face.

This module is the package's one entry: code outside ``megatron/checkpoint/`` imports from here, never from a
submodule (``tests/unit/test_checkpoint_entry.py``; the listed exception is ``cli``, the checkpoint tools' glue).

Training runs:

* :class:`CheckpointConfig` (a run's checkpoint keys), :func:`is_save_iter` (the save schedule)
* :func:`start_uploads` → :class:`S3Uploader` (``s3_path``: committed checkpoints uploaded in the background;
  ``load: s3://...`` is downloaded by ``load_checkpoint``, ``s3_download``)
* :func:`save_checkpoint` (crash-safe, ``commit``) and :func:`load_checkpoint` → :class:`LoadResult` (resume
  selection in ``resume``, resharding on load in ``autoreshard``, optimizer carry-over in ``optimizer_carry``)

Any checkpoint, offline:

* :func:`read_checkpoint` → :class:`NeoXCheckpoint` (full state dict in ``sequential.<idx>.`` names + config)
* :func:`write_checkpoint` (full state dict → DeepSpeed layout for a :class:`TargetLayout`)
* :func:`reshard_checkpoint` (any → any; ZeRO-0/1/2/3 and bf16-optimizer state come along in ZeRO-0 form)
* :func:`export_hf` / :func:`import_hf` (Hugging Face folders)
* :func:`convert_to_universal` (DeepSpeed's ``ds_to_universal``; ``load_universal`` loads the result: ``universal``)
* :func:`detect_layout`, :func:`resolve_checkpoint_dir`, :class:`CheckpointError`
"""

from megatron.checkpoint.config_io import model_config
from megatron.checkpoint.hf_io import (
    export_hf,
    hf_tokenizer,
    hf_tokenizer_vocab,
    import_hf,
    neox_config_yaml,
    tokenizer_files,
    tokenizer_yaml,
)
from megatron.checkpoint.inspection import describe_checkpoint, diff_checkpoints
from megatron.checkpoint.layout import (
    CheckpointError,
    CheckpointLayout,
    detect_layout,
    resolve_checkpoint_dir,
    stage_bounds,
)
from megatron.checkpoint.load import LoadResult, load_checkpoint
from megatron.checkpoint.manifest import read_manifest, verify_checkpoint
from megatron.checkpoint.optimizer_state import slice_param_names, stage_param_names
from megatron.checkpoint.partition import partition_balanced
from megatron.checkpoint.reader import NeoXCheckpoint, read_checkpoint
from megatron.checkpoint.reshard import ReshardResult, reshard_checkpoint
from megatron.checkpoint.rules import resize_vocab
from megatron.checkpoint.run_config import CHECKPOINT_ARG_KEYS, CheckpointConfig, is_save_iter
from megatron.checkpoint.s3_upload import S3Uploader, start_uploads
from megatron.checkpoint.save import save_checkpoint
from megatron.checkpoint.tags import checkpoint_tag
from megatron.checkpoint.tokenizer_identity import tokenizer_identity
from megatron.checkpoint.universal_convert import convert_to_universal
from megatron.checkpoint.writer import TargetLayout, write_checkpoint

__all__ = [
    "CHECKPOINT_ARG_KEYS",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointLayout",
    "LoadResult",
    "NeoXCheckpoint",
    "ReshardResult",
    "S3Uploader",
    "TargetLayout",
    "checkpoint_tag",
    "convert_to_universal",
    "describe_checkpoint",
    "detect_layout",
    "diff_checkpoints",
    "export_hf",
    "hf_tokenizer",
    "hf_tokenizer_vocab",
    "import_hf",
    "is_save_iter",
    "load_checkpoint",
    "model_config",
    "neox_config_yaml",
    "partition_balanced",
    "read_checkpoint",
    "read_manifest",
    "reshard_checkpoint",
    "resize_vocab",
    "resolve_checkpoint_dir",
    "save_checkpoint",
    "slice_param_names",
    "stage_bounds",
    "stage_param_names",
    "start_uploads",
    "tokenizer_files",
    "tokenizer_identity",
    "tokenizer_yaml",
    "verify_checkpoint",
    "write_checkpoint",
]
