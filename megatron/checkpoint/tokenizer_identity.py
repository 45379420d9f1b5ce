"""Which tokenizer a checkpoint was trained with, recorded in its client-state ``args`` and compared on load.

Two tokenizers of the same padded size load into the same embedding shapes, so only the tokenizer's identity shows
that token ids would mean other tokens after a resume or finetune. Recorded: ``tokenizer_vocab_file`` (the path, for
the message), ``tokenizer_vocab_size`` and ``tokenizer_vocab_sha256``: the sha256 of the vocabulary itself (the
id → token table, added tokens included), so the same vocabulary serialised differently (GPT-NeoX's
``20B_tokenizer.json`` and a Hugging Face ``tokenizer.json`` of it) or stored elsewhere is the same tokenizer. A
tokenizer without a string vocabulary (``CharLevelTokenizer``) has the sha256 of its ``vocab_file`` (None without
one). ``tokenizer_type`` is one of GPT-NeoX's own checkpoint args. A checkpoint without these keys (GPT-NeoX's,
older ones) is not compared.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from megatron.checkpoint.layout import CheckpointError

logger = logging.getLogger(__name__)

FILE_KEY, VOCAB_KEY, SIZE_KEY = "tokenizer_vocab_file", "tokenizer_vocab_sha256", "tokenizer_vocab_size"
ALLOW_KEY = "load_allow_tokenizer_change"


def vocab_digest(vocab: dict[str, int]) -> str:
    """sha256 of an id → token table (independent of the file it came from)."""
    table = sorted((int(i), str(token)) for token, i in vocab.items())
    return hashlib.sha256(json.dumps(table, ensure_ascii=False).encode()).hexdigest()


def file_sha256(path: str | None) -> str | None:
    """sha256 of a file (None for no file or a folder)."""
    if not path or not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.lru_cache(maxsize=4)  # once per tokenizer object: every save records it
def _identity(tokenizer: Any) -> tuple[str | None, int]:
    try:
        digest = vocab_digest(tokenizer.vocab)
    except NotImplementedError:  # no string vocabulary
        digest = None
    return digest, int(tokenizer.vocab_size)


def tokenizer_identity(tokenizer: Any, vocab_file: str | None) -> dict[str, Any]:
    """The keys recorded in a checkpoint's ``args`` for the run's tokenizer (built from ``vocab_file``)."""
    digest, size = _identity(tokenizer)
    return {FILE_KEY: vocab_file, VOCAB_KEY: digest or file_sha256(vocab_file), SIZE_KEY: size}


def _describe(args: dict[str, Any]) -> str:
    digest = args.get(VOCAB_KEY)
    size = args.get(SIZE_KEY)
    return f"{args.get('tokenizer_type')} {args.get(FILE_KEY)} ({size} tokens, vocabulary sha256 {str(digest)[:12]})"


def check_tokenizer(saved: dict[str, Any], current: dict[str, Any], path: str | Path, allow: bool) -> None:
    """Refuse (or with ``allow`` warn about) a checkpoint saved with another tokenizer than the run's.

    Compared: ``tokenizer_type`` and, where the checkpoint recorded them, the vocabulary's sha256 and size.
    """
    keys = ("tokenizer_type", VOCAB_KEY, SIZE_KEY)
    # a side that does not know a key (an older checkpoint, a caller without the tokenizer) is not compared
    differs = [k for k in keys if k in saved and k in current and saved[k] != current[k]]
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
