"""Build the embedded quick-start corpus: the Python standard library's own sources on this machine, as JSONL.

    python tools/datasets/corpora.py --output data/stdlib/stdlib.jsonl [--max-docs N] [--include-tests]

Each line is ``{"text": <source>, "meta": {"path": <path relative to the stdlib>}}``; files come in sorted
relative-path order, so the corpus is deterministic for a given Python installation. ``site-packages`` (which
depends on what is installed) is always excluded; test suites are excluded unless ``--include-tests``.
No network access.

``DATA_DOWNLOADERS`` maps GPT-NeoX's downloadable dataset names to their URLs (``.name``, ``.urls``), as GPT-NeoX's
module of this name does; ``prepare_data.py NAME`` downloads them.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.data.corpora import build_stdlib_corpus, stdlib_dir
from megatron.data.remote_corpora import DATASETS as DATA_DOWNLOADERS  # noqa: F401 - GPT-NeoX's name


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description="Build a JSONL corpus from the Python standard library sources.")
    parser.add_argument("--output", required=True, help="output .jsonl file")
    parser.add_argument("--max-docs", type=int, default=None, help="stop after N documents")
    parser.add_argument("--include-tests", action="store_true", help="also include the stdlib test suites")
    args = parser.parse_args(argv)
    if args.max_docs is not None and args.max_docs <= 0:
        print("error: --max-docs must be positive", file=sys.stderr)
        return 1
    try:
        docs, nbytes = build_stdlib_corpus(args.output, args.max_docs, args.include_tests)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Wrote {docs} documents ({nbytes / 1e6:.1f} MB of Python source from {stdlib_dir()}) to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
