"""Datasets named on ``prepare_data.py``'s command line: the embedded stdlib corpus, local files, and GPT-NeoX's
downloadable corpora (files already in ``<data-dir>/<name>/`` are used; otherwise they are downloaded, unless
``HF_DATASETS_OFFLINE=1``).

The embedded corpus is the Python standard library's own sources on this machine, as JSONL: one line
``{"text": <source>, "meta": {"path": <path relative to the stdlib>}}`` per file, in sorted relative-path order, so
it is deterministic for a given Python installation; ``site-packages`` is always excluded, test suites unless asked.
"""

from __future__ import annotations

import difflib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron.data.archives import UNPACKING_SUFFIX
from megatron.data.document_reader import SUFFIXES
from megatron.data.preprocess import PreprocessConfig, PreprocessResult, preprocess
from megatron.data.remote_corpora import (
    DATASETS,
    artefacts,
    download_state,
    fetch_dataset,
    fetch_gpt2_tokenizer_files,
)
from megatron.errors import DataError

# GPT-NeoX's prepare_data.py dataset names, downloaded when missing (megatron.data.remote_corpora)
REMOTE_DATASETS = tuple(DATASETS)
EMBEDDED = "stdlib"

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "idle_test"}
TEST_DIRS = {"test", "tests"}


def stdlib_dir() -> str:
    """The interpreter's standard-library directory (``sysconfig``'s ``stdlib`` path)."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_sources(root: str, include_tests: bool = False) -> Iterator[tuple[str, str]]:
    """``(relative path, source)`` of every ``.py`` file under ``root`` in sorted order."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        skip = EXCLUDED_DIRS | (set() if include_tests else TEST_DIRS)
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        found.extend(os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py"))
    for rel in sorted(found):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            yield rel, f.read()


def build_stdlib_corpus(output: str, max_docs: int | None = None, include_tests: bool = False) -> tuple[int, int]:
    """Write the corpus to ``output`` (atomically); returns ``(documents, bytes of text)``."""
    root = stdlib_dir()
    if not os.path.isdir(root):
        raise ValueError(f"standard library directory {root} not found")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".partial"
    docs = nbytes = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for rel, text in stdlib_sources(root, include_tests):
            if not text.strip():
                continue
            f.write(json.dumps({"text": text, "meta": {"path": rel}}, ensure_ascii=False) + "\n")
            docs += 1
            nbytes += len(text.encode("utf-8"))
            if max_docs is not None and docs >= max_docs:
                break
    if docs == 0:
        os.remove(tmp)
        raise ValueError(f"no Python sources found under {root}")
    os.replace(tmp, output)
    return docs, nbytes


@dataclass
class PreparedDataset:
    """What ``prepare_dataset`` tokenized and wrote."""

    name: str
    inputs: list[str]
    output_prefix: str  # ``<data_dir>/<name>/<name>_text_document``
    result: PreprocessResult


def _local_inputs(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(
        os.path.join(dirpath, f)
        for dirpath, _, files in os.walk(path)
        if not any(part.endswith(UNPACKING_SUFFIX) for part in Path(dirpath).parts)  # a stopped unpacking
        for f in files
        if f.endswith(SUFFIXES) and not f.endswith((".partial", ".tar.gz", ".tgz"))  # archives are unpacked first
    )


def offline() -> bool:
    """``HF_DATASETS_OFFLINE=1`` (the Hugging Face switch for dataset downloads) forbids downloading corpora."""
    return os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _remote_inputs(dataset: str, data_dir: str, force_redownload: bool) -> list[str]:
    """The documents of GPT-NeoX's corpus ``dataset``: the ones put in its folder by hand, else those of a finished
    download (an unfinished one, or ``-f``, downloads and unpacks first; each time, a download's checks run)."""
    folder = os.path.join(data_dir, dataset)
    state = download_state(dataset, folder)
    inputs = _local_inputs(folder) if os.path.isdir(folder) else []
    if state is None and inputs and not force_redownload:
        return inputs
    if (state is not True or force_redownload) and offline():
        raise DataError(
            f"dataset {dataset!r} has to be downloaded and downloads are off (HF_DATASETS_OFFLINE=1): put its "
            f"documents ({', '.join(SUFFIXES)}) in {folder}/, pass a local file or folder, or use {EMBEDDED!r}"
        )
    if force_redownload:
        for stale in artefacts(DATASETS[dataset], Path(folder)):
            stale.unlink(missing_ok=True)
    fetch_dataset(dataset, folder)
    inputs = _local_inputs(folder)
    if not inputs:
        raise DataError(f"dataset {dataset!r}: the download holds no documents ({', '.join(SUFFIXES)}) in {folder}")
    return inputs


def _resolve(dataset: str, data_dir: str, force_redownload: bool, max_docs: int | None) -> tuple[str, list[str]]:
    """``(name, input files)`` for a dataset name or a local path."""
    if dataset == EMBEDDED:
        corpus = os.path.join(data_dir, EMBEDDED, f"{EMBEDDED}.jsonl")
        if not os.path.isfile(corpus) or force_redownload or max_docs is not None:
            build_stdlib_corpus(corpus, max_docs)
        return EMBEDDED, [corpus]
    if os.path.exists(dataset):
        inputs = _local_inputs(dataset)
        if not inputs:
            raise ValueError(f"{dataset}: no input files in it (valid suffixes: {', '.join(SUFFIXES)})")
        name = os.path.basename(os.path.normpath(dataset))
        for suffix in SUFFIXES:
            name = name.removesuffix(suffix)
        return name, inputs
    if dataset in REMOTE_DATASETS:
        return dataset, _remote_inputs(dataset, data_dir, force_redownload)
    close = difflib.get_close_matches(dataset, [EMBEDDED, *REMOTE_DATASETS], n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise ValueError(
        f"unknown dataset {dataset!r}: not a local file or folder, and not one of {EMBEDDED}, "
        f"{', '.join(REMOTE_DATASETS)}{hint}"
    )


def prepare_dataset(
    dataset_name: str,
    tokenizer_type: str = "GPT2BPETokenizer",
    data_dir: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    force_redownload: bool = False,
    workers: int = 1,
    max_docs: int | None = None,
) -> PreparedDataset:
    """GPT-NeoX's ``prepare_dataset``: tokenize into ``<data_dir>/<name>/<name>_text_document.{bin,idx}`` with an EOD
    after each document. GPT-2's vocab/merges default to ``<data_dir>/gpt2-vocab.json`` / ``gpt2-merges.txt``."""
    data_dir = data_dir or "data"
    if tokenizer_type == "GPT2BPETokenizer":
        vocab_file = vocab_file or os.path.join(data_dir, "gpt2-vocab.json")
        merge_file = merge_file or os.path.join(data_dir, "gpt2-merges.txt")
        missing = [p for p in (vocab_file, merge_file) if not os.path.isfile(p)]
        defaults = (os.path.join(data_dir, "gpt2-vocab.json"), os.path.join(data_dir, "gpt2-merges.txt"))
        if missing and (vocab_file, merge_file) == defaults and not offline():
            fetch_gpt2_tokenizer_files(vocab_file, merge_file)  # GPT-NeoX downloads them too
            missing = []
        if missing:
            why = " (downloads are off: HF_DATASETS_OFFLINE=1)" if offline() else ""
            raise ValueError(
                f"GPT2BPETokenizer needs GPT-2's vocab and merges files, not found: {', '.join(missing)}{why}: pass "
                "-v/--vocab-file and -m/--merge-file, or another --tokenizer"
            )
    name, inputs = _resolve(dataset_name, data_dir, force_redownload, max_docs)
    prefix = os.path.join(data_dir, name, name)
    cfg = PreprocessConfig(
        inputs=inputs,
        output_prefix=prefix,
        tokenizer_type=tokenizer_type,
        vocab_file=vocab_file,
        merge_file=merge_file,
        append_eod=True,
        workers=workers,
    )
    folder = os.path.dirname(prefix)
    created = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    try:
        result = preprocess(cfg)
    except BaseException:
        if created and not os.listdir(folder):
            os.rmdir(folder)  # leave nothing behind on bad input
        raise
    return PreparedDataset(name, inputs, f"{prefix}_text_document", result)
