"""Which encoder tokenises a preprocessing run: the fast byte-level BPE encoder only when it is proven identical.

The fast encoder (:mod:`megatron.tokenizer.fast_bpe`) is built only for a tokenizer whose merge table makes it
give ``tokenizers``' ids for every text (its builder checks the merges). As a smoke test on top, a small sample
of the input (the first documents of each file and, in plain JSONL files, documents at evenly spread offsets) is
encoded with both; on any difference the whole run uses the tokenizer. The decision is one log line.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.data.document_reader import read_documents
from megatron.tokenizer.fast_bpe import FastBPE, build_fast_bpe

FAST_NAME = "tiktoken"
PLAIN_NAME = "tokenizers"
# The smoke test must stay a small fraction of any real run: each sample text is at most a prefix of 4 K characters
# of its document, and the sample stops at 64 K characters (~0.03 s for tokenizers on an idle core).
_MAX_SAMPLE_CHARS = 4096
_SAMPLE_BUDGET = 64 * 1024


@dataclass
class EncoderChoice:
    """The fast encoder (None: the tokenizer's own ``tokenize_batch``) and the log line saying why."""

    fast: FastBPE | None
    line: str

    @property
    def name(self) -> str:
        return FAST_NAME if self.fast is not None else PLAIN_NAME


def plain(why: str) -> EncoderChoice:
    return EncoderChoice(None, f"encoder: {PLAIN_NAME} (fast encoder not used: {why})")


def tokenizer_json(tokenizer: Any) -> str | None:
    """The ``tokenizers`` JSON behind a tokenizer of this project (None for other backends)."""
    backend = getattr(tokenizer, "tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    if type(tokenizer).__name__ not in ("HFTokenizer", "GPT2BPETokenizer") or to_str is None:
        return None
    return str(to_str())


def tokenizer_model(tokenizer: Any) -> Any:
    """The ``tokenizers`` model behind a tokenizer that :func:`tokenizer_json` reads (None for others)."""
    return getattr(getattr(tokenizer, "tokenizer", None), "model", None)


def _spread_lines(path: str, keys: Sequence[str], count: int) -> Iterator[tuple[str, dict[str, str]]]:
    """Documents at ``count`` evenly spread byte offsets of a plain JSONL file (lines that do not parse are skipped:
    the run itself reports them)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        for k in range(1, count + 1):
            offset = size * k // (count + 1)
            f.seek(offset)
            f.readline()  # the rest of the line the offset fell in
            line = f.readline()
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and all(isinstance(doc.get(key), str) for key in keys):
                yield f"{path} @byte {offset}", {key: doc[key] for key in keys}


def sample_texts(inputs: Sequence[str], keys: Sequence[str], head: int = 16, spread: int = 16) -> list[tuple[str, str]]:
    """``(where, text)`` of the sample: from at most 8 input files (spread over the list), each with an equal share
    of the character budget, the first ``head`` documents alternating with ``spread`` documents from across the file
    (plain ``.jsonl`` files only; a compressed file is read from its start)."""
    files = [f for f in inputs if os.path.isfile(f)]  # a pipe would lose what the sample read; a missing file is
    if len(files) > 8:  # the run's error to report
        files = [files[i * (len(files) - 1) // 7] for i in range(8)]
    out: list[tuple[str, str]] = []
    for path in files:
        first: list[tuple[str, dict[str, str]]] = []
        across: list[tuple[str, dict[str, str]]] = []
        try:
            reader = read_documents([path], list(keys), skip_invalid=True)
            first.extend((f"{path} document {n + 1}", d) for n, d in enumerate(itertools.islice(reader, head)))
            if path.endswith(".jsonl"):
                across.extend(_spread_lines(path, keys, spread))
        except (ValueError, OSError, EOFError):
            pass  # the run reports the bad input with file and line
        budget = _SAMPLE_BUDGET // len(files)
        for pair in itertools.zip_longest(first, across):
            for where, doc in (d for d in pair if d is not None):
                for key in keys:
                    if budget > 0:
                        out.append((f"{where} ({key})", doc[key][:_MAX_SAMPLE_CHARS]))
                        budget -= len(out[-1][1])
    return out


def choose_encoder(
    tokenizer: Any,
    inputs: Sequence[str],
    keys: Sequence[str],
    allow_fast: bool = True,
    fix: Callable[[str], str] | None = None,
    build: Callable[[str, Any], tuple[FastBPE | None, str]] = build_fast_bpe,
) -> EncoderChoice:
    """Build the fast encoder for ``tokenizer`` (its builder checks the merge table) and compare it with
    ``tokenizer.tokenize_batch`` on a sample of ``inputs`` (after ``fix``, as the run applies it). ``build`` is the
    fast encoder's builder (a seam for tests)."""
    if not allow_fast:
        return plain("disabled (--no-fast-encoder)")
    spec = tokenizer_json(tokenizer)
    if spec is None:
        return plain(f"{type(tokenizer).__name__} is not a tokenizers byte-level BPE")
    fast, why = build(spec, tokenizer_model(tokenizer))
    if fast is None:
        return plain(why)
    sample = sample_texts(inputs, keys)
    if not sample:
        return plain("no sample documents to compare")
    texts = [fix(t) if fix is not None else t for _, t in sample]
    try:
        got = fast.encode_batch(texts)
    except Exception as e:  # e.g. a lone surrogate: the tokenizer decides what happens to such text
        return plain(f"the fast encoder failed on the sample ({type(e).__name__})")
    try:
        want = tokenizer.tokenize_batch(texts)
    except Exception:
        return plain("the tokenizer failed on the sample")
    for (where, _), a, b in zip(sample, got, want, strict=True):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return plain(f"ids differ from tokenizers on {where} at token {at}")
    n = len(texts)
    return EncoderChoice(fast, f"encoder: {FAST_NAME} ({why}; also identical on {n}/{n} sample documents)")
