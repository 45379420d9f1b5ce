"""Which tokenizer a checkpoint was trained with, recorded in its client-state ``args`` and compared on load.

Two tokenizers of the same padded size load into the same embedding shapes, so only the tokenizer's identity shows
that token ids would mean other tokens after a resume or finetune. Recorded: ``tokenizer_vocab_file`` (the path, for
the message) and ``tokenizer_vocab_sha256`` (the sha256 of ``vocab_file``, as ``sha256sum`` prints it; with a
``merge_file`` also ``tokenizer_merge_sha256``; a tokenizer folder: its ``tokenizer.json`` or vocabulary files).
``tokenizer_type`` is one of GPT-NeoX's own checkpoint args. A checkpoint without these keys (GPT-NeoX's, older
ones) is not compared.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from megatron.checkpoint.layout import CheckpointError

logger = logging.getLogger(__name__)

FILE_KEY, VOCAB_KEY, MERGE_KEY = "tokenizer_vocab_file", "tokenizer_vocab_sha256", "tokenizer_merge_sha256"
FOLDER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model")
ALLOW_KEY = "load_allow_tokenizer_change"


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str | Path | None) -> str | None:
    """sha256 of a tokenizer file, or of a tokenizer folder's vocabulary files; None when there is no such file."""
    if not path or not os.path.exists(path):
        return None
    if os.path.isdir(path):
        parts = [f"{name}:{file_sha256(os.path.join(path, name))}" for name in FOLDER_FILES]
        present = [p for p in parts if not p.endswith(":None")]
        return hashlib.sha256("\n".join(present).encode()).hexdigest() if present else None
    stat = os.stat(path)
    return _sha256(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def tokenizer_identity(vocab_file: str | None, merge_file: str | None = None) -> dict[str, Any]:
    """The keys recorded in a checkpoint's ``args`` for the run's tokenizer files."""
    out: dict[str, Any] = {FILE_KEY: vocab_file, VOCAB_KEY: file_sha256(vocab_file)}
    if merge_file:
        out[MERGE_KEY] = file_sha256(merge_file)
    return out


def _describe(args: dict[str, Any]) -> str:
    digest = args.get(VOCAB_KEY)
    return f"{args.get('tokenizer_type')} {args.get(FILE_KEY)} (sha256 {str(digest)[:12] if digest else 'none'})"


def check_tokenizer(saved: dict[str, Any], current: dict[str, Any], path: str | Path, allow: bool) -> None:
    """Refuse (or with ``allow`` warn about) a checkpoint saved with another tokenizer than the run's.

    Compared: ``tokenizer_type`` and, where the checkpoint recorded them, the sha256 of the vocabulary / merge files.
    """
    differs = [k for k in ("tokenizer_type", VOCAB_KEY, MERGE_KEY) if k in saved and saved[k] != current.get(k)]
    if not differs:
        return
    message = (
        f"checkpoint {path} was saved with tokenizer {_describe(saved)} but this run's is {_describe(current)} "
        f"({', '.join(differs)} differ): its token ids would mean other tokens"
    )
    if allow:
        logger.warning("%s; loading anyway (%s: true)", message, ALLOW_KEY)
        return
    raise CheckpointError(
        f"{message}; use the checkpoint's tokenizer, or set {ALLOW_KEY}: true to load it on purpose (e.g. to "
        "retrain the embeddings)"
    )
