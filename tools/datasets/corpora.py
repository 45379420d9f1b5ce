"""Build the embedded quick-start corpus: the Python standard library's own sources on this machine, as JSONL.

    python tools/datasets/corpora.py --output data/stdlib/stdlib.jsonl [--max-docs N] [--include-tests]

Each line is ``{"text": <source>, "meta": {"path": <path relative to the stdlib>}}``; files come in sorted
relative-path order, so the corpus is deterministic for a given Python installation. ``site-packages`` (which
depends on what is installed) is always excluded; test suites are excluded unless ``--include-tests``.
No network access.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from collections.abc import Iterator

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
