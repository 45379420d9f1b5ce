"""Merge every ``.bin``/``.idx`` dataset in a directory (sorted by name) into one dataset.

    python tools/datasets/merge_datasets.py --input DIR --output-prefix OUT

All inputs must share one format and dtype. Document boundaries of every input are kept.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.data import indexed_dataset as ids


def find_prefixes(directory: str) -> list[str]:
    """Dataset prefixes in ``directory``; raises ValueError when a ``.bin`` lacks its ``.idx`` or vice versa."""
    prefixes = set()
    for name in os.listdir(directory):
        stem, ext = os.path.splitext(name)
        if ext not in (".bin", ".idx") or not os.path.isfile(os.path.join(directory, name)):
            continue
        other = os.path.join(directory, stem + (".idx" if ext == ".bin" else ".bin"))
        if not os.path.isfile(other):
            raise ValueError(f"{os.path.join(directory, name)} has no matching {other}")
        prefixes.add(os.path.join(directory, stem))
    if not prefixes:
        raise ValueError(f"--input {directory!r} holds no .bin/.idx datasets")
    return sorted(prefixes)


def merge(directory: str, output_prefix: str) -> tuple[int, int]:
    """Merge the datasets; returns ``(number of inputs, total items)``."""
    prefixes = find_prefixes(directory)
    first = ids.make_dataset(prefixes[0], "infer")
    if isinstance(first, ids.MMapIndexedDataset):
        builder = ids.MMapIndexedDatasetBuilder(output_prefix + ".bin", dtype=first.dtype)
        for prefix in prefixes:
            builder.merge_file_(prefix)
        builder.finalize(output_prefix + ".idx")
    else:
        from megatron.data.legacy_indexed_dataset import IndexedDatasetBuilder

        legacy = IndexedDatasetBuilder(output_prefix + ".bin", dtype=first.dtype)
        for prefix in prefixes:
            ds = ids.make_dataset(prefix, "infer")
            for i in range(len(ds)):
                legacy.add_item(ds[i])
            legacy.end_document()
        legacy.finalize(output_prefix + ".idx")
    return len(prefixes), len(ids.make_dataset(output_prefix, "infer"))


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="directory containing the datasets to merge")
    parser.add_argument("--output-prefix", required=True, help="output prefix (no suffix)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.input):
        print(f"error: --input {args.input} is not a directory", file=sys.stderr)
        return 1
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        print(f"error: --output-prefix directory {out_dir} does not exist", file=sys.stderr)
        return 1
    try:
        count, items = merge(args.input, args.output_prefix)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Merged {count} datasets ({items} items) into {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
