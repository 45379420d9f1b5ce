"""Write a DeepSpeed universal checkpoint from a neox-forge checkpoint, with DeepSpeed's own ``ds_to_universal``.

    python tools/ckpts/convert_to_universal.py --input_dir ckpts/global_step100
    # -> ckpts/global_step100_universal and ckpts/latest_universal; then train with
    #    load: ckpts, load_universal: true (any TP/PP/DP size, ZeRO stage >= 1 or bf16)

The checkpoint must have ZeRO-1/2/3 or bf16-optimizer shards and the ``universal_checkpoint_info`` every
neox-forge save writes; see docs/checkpoints.md ("Universal checkpoints").
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.checkpoint import cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", required=True, help="checkpoint root (with 'latest') or a global_stepN dir")
    p.add_argument(
        "--output_dir", default=None, help="universal folder to create (default: <root>/<global_stepN>_universal)"
    )
    p.add_argument("--iteration", type=int, default=None, help="which global_stepN of a root (default: 'latest')")
    p.add_argument("--workers", type=int, default=1, help="processes extracting and merging shards (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_dir")
    return cli.parse_tool_args(p, argv, quiet=False)


def main(argv: list[str] | None = None) -> int:
    """Convert; returns the exit code."""
    args = parse_args(argv)
    cli.apply_tool_args(args)
    from megatron.checkpoint import convert_to_universal

    out = convert_to_universal(
        args.input_dir, args.output_dir, iteration=args.iteration, workers=args.workers, overwrite=args.overwrite
    )
    print(
        f"universal checkpoint {out} ({out.parent / 'latest_universal'} names it): load: {out.parent}, load_universal: true"
    )
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
