"""Where the project's shared reference files (tokenizers, corpora, GPT-NeoX configs) are, for tests only.

The project never reads them at run time. They normally lie in ``shared/`` beside the clone; ``NEOX_FORGE_SHARED``
points elsewhere. Tests that need them skip when they are absent, except under CI (``CI=true``), where a missing
``shared/`` is an error so that coverage cannot silently shrink.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _find() -> Path:
    candidates = [os.environ.get("NEOX_FORGE_SHARED"), REPO_ROOT.parent / "shared"]
    for candidate in candidates:
        if candidate and all((Path(candidate) / sub).is_dir() for sub in ("data", "reference")):
            return Path(candidate)
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"shared/ reference files not found (looked in {candidates}); set NEOX_FORGE_SHARED")
    return REPO_ROOT.parent / "shared"


SHARED = _find()


def shared_file(*parts: str) -> Path:
    """``SHARED/<parts>``; a test that needs it skips when it is absent (``_find`` already failed under CI)."""
    import pytest

    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared reference file {path} is not on this machine (set NEOX_FORGE_SHARED)")
    return path


def train_shakespeare_spm(model_prefix: Path, vocab_size: int, lines: int = 3000) -> Path:
    """A small SentencePiece BPE model on tinyshakespeare with GPT-NeoX's special tokens; returns the .model path."""
    import sentencepiece as spm

    text = shared_file("data", "corpora", "tinyshakespeare.txt").read_text().splitlines()[:lines]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_prefix=str(model_prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        user_defined_symbols=["<|endoftext|>", "<|padding|>"],
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    return Path(f"{model_prefix}.model")
