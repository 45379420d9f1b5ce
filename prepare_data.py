#!/usr/bin/env python
"""GPT-NeoX's ``prepare_data.py``: tokenize a dataset into ``data/<name>/<name>_text_document.{bin,idx}``.

    python prepare_data.py stdlib -t HFTokenizer -v tokenizer.json       # the embedded corpus (no network)
    python prepare_data.py my_docs.jsonl -t HFTokenizer -v tokenizer.json  # a local file or folder
    python prepare_data.py enwik8                                          # GPT-NeoX's names: downloaded

GPT-NeoX's dataset names (enwik8, pile, ...) use the files already in ``<data-dir>/<name>/``, else download them
(resumable, verified, atomic; GPT-2's vocab/merges too); with ``HF_DATASETS_OFFLINE=1`` a missing dataset is an
error saying so.
"""

from __future__ import annotations

import argparse
import sys

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.data.corpora import EMBEDDED, REMOTE_DATASETS, prepare_dataset
from megatron.tokenizer import TOKENIZER_TYPES


def get_args(input_args: list[str] | None = None) -> argparse.Namespace:
    """GPT-NeoX's flags, plus ``--workers`` and ``--max-docs``; the dataset may also be a local path."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ", ".join([EMBEDDED, *REMOTE_DATASETS])
    p.add_argument("dataset", nargs="?", default="enwik8", help=f"a local file or folder, or one of: {names}")
    p.add_argument("-t", "--tokenizer", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES, help="tokenizer type")
    p.add_argument("-d", "--data-dir", default=None, help="where datasets and GPT-2's files live (default ./data)")
    p.add_argument("-v", "--vocab-file", default=None, help="tokenizer vocab file (if the tokenizer needs one)")
    p.add_argument("-m", "--merge-file", default=None, help="tokenizer merges file (GPT2BPETokenizer)")
    p.add_argument("-f", "--force-redownload", dest="force_redownload", action="store_true", help="rebuild inputs")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--max-docs", type=int, default=None, help="stdlib only: stop the corpus after N documents")
    return p.parse_args(input_args)


def main(input_args: list[str] | None = None) -> int:
    """Entry point; returns the exit status (bad input: one line on stderr, status 1)."""
    args = get_args(input_args)
    try:
        done = prepare_dataset(
            dataset_name=args.dataset,
            tokenizer_type=args.tokenizer,
            data_dir=args.data_dir,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            force_redownload=args.force_redownload,
            workers=args.workers,
            max_docs=args.max_docs,
        )
    except (ValueError, OSError) as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 1
    r = done.result
    print(f"{done.name}: {r.documents} documents, {r.tokens} tokens from {len(done.inputs)} file(s)")
    print(f"Wrote {done.output_prefix}.bin and {done.output_prefix}.idx (data_path: {done.output_prefix})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
