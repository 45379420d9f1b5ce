"""Tokenise documents into ``{prefix}_{key}_document.bin/.idx`` (the engine of ``tools/datasets/preprocess_data.py``).

Documents are read in the main process (so bad lines are reported with file and line), grouped in batches,
tokenised with the tokenizer's batched encoder (in ``workers`` processes when ``workers > 1``), and written in
input order, so the output is byte-identical for any number of workers. A byte-level BPE ``tokenizers`` JSON is
encoded by the fast encoder instead when it gives the same ids on a sample of the input
(:mod:`megatron.data.encoder_choice`; ``fast_encoder=False`` turns it off); the log line ``encoder: ...`` says which.
Output goes to ``*.partial`` files that
are renamed only when everything succeeded.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from megatron.data.document_reader import ReadStats, read_documents
from megatron.data.encoder_choice import EncoderChoice, choose_encoder, tokenizer_json, tokenizer_model
from megatron.data.indexed_dataset import make_builder
from megatron.data.staged_output import staged_builders, worker_pool
from megatron.errors import DataError
from megatron.logging.progress import progress as progress_bar
from megatron.neox_arguments.sections.other import TOKENIZER_TYPES
from megatron.tokenizer import TokenizerConfig, build_tokenizer
from megatron.tokenizer.fast_bpe import FastBPE, build_fast_bpe

logger = logging.getLogger(__name__)


@dataclass
class PreprocessConfig:
    """Options of ``preprocess_data.py`` (GPT-NeoX's flags)."""

    inputs: list[str]
    output_prefix: str
    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    jsonl_keys: list[str] = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    ftfy: bool = False
    dataset_impl: str = "mmap"
    workers: int = 1
    log_interval: int = 100
    num_docs: int | None = None
    skip_invalid: bool = False
    batch_docs: int = 64
    batch_chars: int = 256 * 1024
    fast_encoder: bool = True

    def tokenizer_config(self) -> TokenizerConfig:
        # build_tokenizer refuses a name that is not one of the schema's tokenizer types
        return TokenizerConfig(
            tokenizer_type=cast(TOKENIZER_TYPES, self.tokenizer_type),
            vocab_file=self.vocab_file,
            merge_file=self.merge_file,
        )


@dataclass
class PreprocessResult:
    """What was written."""

    outputs: dict[str, str]
    documents: int
    tokens: int
    bytes_in: int
    seconds: float
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    encoder: str = ""


def output_prefix_for(prefix: str, key: str) -> str:
    """GPT-NeoX's output name: ``{prefix}_{key}_document``."""
    return f"{prefix}_{key}_document"


# --- worker side -------------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}
_CHOSEN: dict[str, FastBPE] = {}  # the main process's fast encoder, inherited by forked workers


def _init_worker(cfg: PreprocessConfig, dtype: str, single_thread: bool, use_fast: bool = False) -> None:
    if single_thread:
        # Several worker processes: keep each one's Rust thread pool to one thread (set before the first encode).
        os.environ["RAYON_NUM_THREADS"] = "1"
    tok = _WORKER["tok"] = build_tokenizer(cfg.tokenizer_config())
    _WORKER["fast"] = None
    if use_fast:
        fast = _CHOSEN.get("fast")
        if fast is None:  # a spawned worker: build it again (the main process proved it identical)
            spec = tokenizer_json(tok)
            fast, why = build_fast_bpe(spec, tokenizer_model(tok)) if spec is not None else (None, "no tokenizers JSON")
            if fast is None:
                raise DataError(f"the fast encoder could not be rebuilt in a worker: {why}")
        _WORKER["fast"] = fast
    _WORKER["cfg"] = cfg
    _WORKER["dtype"] = np.dtype(dtype)
    if cfg.ftfy:
        import ftfy

        _WORKER["fix"] = ftfy.fix_text


def encode_batch(docs: list[dict[str, str]]) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]:
    """Tokenise a batch: per key ``(flat tokens, tokens per document)``, plus the batch's UTF-8 byte count."""
    tok, cfg, dtype = _WORKER["tok"], _WORKER["cfg"], _WORKER["dtype"]
    fix = _WORKER.get("fix")
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    nbytes = 0
    for key in cfg.jsonl_keys:
        texts = [d[key] for d in docs]
        if fix is not None:
            texts = [fix(t) for t in texts]
        nbytes += sum(len(t.encode("utf-8")) for t in texts)
        ids = _tokenize_batch(tok, _WORKER["fast"], texts)
        if cfg.append_eod:
            eod = tok.eod
            for seq in ids:
                seq.append(eod)
        lengths = np.fromiter((len(s) for s in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        if len(flat) and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
            raise DataError(f"token ids out of range for the output dtype {dtype}")
        out[key] = (flat.astype(dtype, copy=False), lengths)
    return out, nbytes


def _tokenize_batch(tok: Any, fast: FastBPE | None, texts: list[str]) -> list[list[int]]:
    if fast is not None:
        try:
            return fast.encode_batch(texts)
        except Exception:  # e.g. a lone surrogate: the tokenizer decides (an error or ids), exactly as without
            pass
    ids: list[list[int]] = tok.tokenize_batch(texts)
    return ids


# --- main process ------------------------------------------------------------------------------------------------


class _Progress:
    """A bar with documents/s, tokens/s and MB/s on a terminal (rates refreshed every ``interval`` documents);
    ``close()`` writes the final rates as one line whatever the stream."""

    def __init__(self, interval: int, total: int | None, stream: Any) -> None:
        self.interval, self.total, self.stream = max(1, interval), total, stream
        self.start = time.perf_counter()
        self.docs = self.tokens = self.bytes = 0
        self._next = self.interval
        self.bar = progress_bar(desc="tokenizing", total=total, unit="doc", stream=stream)

    def line(self) -> str:
        dt = max(time.perf_counter() - self.start, 1e-9)
        done = f"{self.docs}/{self.total}" if self.total else f"{self.docs}"
        return (
            f"{done} docs | {self.docs / dt:.1f} docs/s | {self.tokens / dt:,.0f} tokens/s | "
            f"{self.bytes / dt / 1e6:.2f} MB/s"
        )

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        if self.docs >= self._next:
            self._next = (self.docs // self.interval + 1) * self.interval
            dt = max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{self.tokens / dt:,.0f} tokens/s, {self.bytes / dt / 1e6:.2f} MB/s", False)
        self.bar.update(docs)

    def close(self) -> None:
        self.bar.close()
        self.stream.write(self.line() + "\n")
        self.stream.flush()


def _batches(cfg: PreprocessConfig, stats: ReadStats) -> Any:
    # Batches are bounded by documents and by characters, so that workers get similar amounts of work.
    batch: list[dict[str, str]] = []
    chars = 0
    for doc in read_documents(cfg.inputs, cfg.jsonl_keys, cfg.skip_invalid, stats):
        batch.append(doc)
        chars += sum(len(t) for t in doc.values())
        if len(batch) >= cfg.batch_docs or chars >= cfg.batch_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def preprocess(
    cfg: PreprocessConfig, progress_stream: Any = None, on_batch: Callable[[int], None] | None = None
) -> PreprocessResult:
    """Run the whole preprocessing; raises ValueError (file:line for bad input) and leaves no output then."""
    if cfg.dataset_impl not in ("mmap", "cached", "lazy"):
        raise DataError(f"--dataset-impl {cfg.dataset_impl!r} is not one of mmap, cached, lazy")
    if cfg.workers < 1:
        raise DataError(f"--workers must be >= 1, got {cfg.workers}")
    if not cfg.jsonl_keys:
        raise DataError("--jsonl-keys: at least one key is needed")
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"--output-prefix: directory {out_dir} does not exist")
    tokenizer = build_tokenizer(cfg.tokenizer_config())
    choice = _choose(cfg, tokenizer)
    final = {key: output_prefix_for(cfg.output_prefix, key) for key in cfg.jsonl_keys}
    stats = ReadStats()
    progress = _Progress(cfg.log_interval, cfg.num_docs, progress_stream or sys.stderr)
    tokens = nbytes = 0

    def make(_key: str, partial_bin: str) -> Any:
        return make_builder(partial_bin, impl=cfg.dataset_impl, vocab_size=tokenizer.vocab_size)

    start = time.perf_counter()
    with staged_builders(final, make) as builders:
        dtype = next(iter(builders.values())).dtype

        def write(result: tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]) -> None:
            nonlocal tokens, nbytes
            per_key, batch_bytes = result
            ndocs = 0
            for key, (flat, lengths) in per_key.items():
                _write_documents(builders[key], flat, lengths)
                tokens += len(flat)
                ndocs = len(lengths)
            nbytes += batch_bytes
            progress.update(ndocs, int(sum(len(f) for f, _ in per_key.values())), batch_bytes)
            if on_batch is not None:
                on_batch(ndocs)

        if cfg.workers == 1:
            _init_worker(cfg, dtype.name, False, choice.fast is not None)
            for batch in _batches(cfg, stats):
                write(encode_batch(batch))
        else:
            with worker_pool(cfg.workers, _init_worker, (cfg, dtype.name, True, choice.fast is not None)) as pool:
                pending: deque[Any] = deque()
                for batch in _batches(cfg, stats):
                    pending.append(pool.apply_async(encode_batch, (batch,)))
                    while len(pending) > 4 * cfg.workers:
                        write(pending.popleft().get())
                while pending:
                    write(pending.popleft().get())
        if stats.documents == 0:
            raise DataError(
                f"no documents in {', '.join(cfg.inputs)} ({stats.skipped} invalid lines skipped, "
                f"{stats.empty} empty documents); nothing written"
            )
    progress.close()
    return PreprocessResult(
        outputs=final,
        documents=stats.documents,
        tokens=tokens,
        bytes_in=nbytes,
        seconds=time.perf_counter() - start,
        skipped=stats.skipped,
        skipped_examples=stats.skipped_examples,
        encoder=choice.line,
    )


def _choose(cfg: PreprocessConfig, tokenizer: Any) -> EncoderChoice:
    """The run's encoder, logged in one line."""
    fix = None
    if cfg.ftfy:
        import ftfy

        fix = ftfy.fix_text
    choice = choose_encoder(tokenizer, cfg.inputs, cfg.jsonl_keys, cfg.fast_encoder, fix)
    _CHOSEN.clear()
    if choice.fast is not None:
        _CHOSEN["fast"] = choice.fast
    logger.info(choice.line)
    return choice


def _write_documents(builder: Any, flat: np.ndarray, lengths: np.ndarray) -> None:
    """One item per document followed by ``end_document`` (a document without tokens adds no item)."""
    if hasattr(builder, "add_documents"):
        builder.add_documents(flat, lengths)
        return
    offset = 0
    for n in lengths:
        if n:
            builder.add_item(flat[offset : offset + n])
        offset += n
        builder.end_document()
