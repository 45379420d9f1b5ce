"""Print the number of tokens (and documents) of preprocessed datasets.

python tools/datasets/dataset_token_count.py data/x_text_document [more prefixes ...]
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)

import numpy as np  # isort: skip  (after the setup check)

from megatron.data.indexed_dataset import make_dataset


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: one line per dataset; exit 1 if any could not be read."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: dataset_token_count.py PREFIX [PREFIX ...]", file=sys.stderr)
        return 1
    code = 0
    for prefix in args:
        try:
            ds = make_dataset(prefix, "infer")
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
            continue
        tokens = int(np.sum(ds.sizes, dtype=np.int64))
        print(f"{prefix}: {tokens} tokens in {len(ds)} items")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
