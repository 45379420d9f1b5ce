"""List what a GPT-NeoX checkpoint holds (layout, iteration, config, tensors, shapes, dtypes) or diff two.

    python tools/ckpts/inspect_checkpoints.py ckpts/global_step1000 [--attributes qkv norm]
    python tools/ckpts/inspect_checkpoints.py ckpts_a --diff ckpts_b [--atol 1e-6]
    python tools/ckpts/inspect_checkpoints.py ckpts --verify      # sizes and sha256 against manifest.json

A diff compares the merged (tp=1) tensors, so checkpoints of different TP/PP layouts can be compared. Exit code 0
when equal, 2 when they differ.
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
    p.add_argument("dir", help="checkpoint root, global_stepN dir, or a single .pt file")
    p.add_argument("--attributes", nargs="*", default=None, help="only tensors whose name contains one of these")
    p.add_argument("--diff", default=None, help="second checkpoint to compare with")
    p.add_argument("--config_file", nargs="*", default=None, help="GPT-NeoX YAML(s) for --diff")
    p.add_argument("--atol", type=float, default=0.0, help="--diff: ignore differences up to this")
    p.add_argument("--verify", action="store_true", help="check every file's size and sha256 against manifest.json")
    return cli.parse_tool_args(p, argv, quiet=False)


def main(argv: list[str] | None = None) -> int:
    """Inspect or diff; returns the exit code."""
    args = parse_args(argv)
    cli.apply_tool_args(args)
    from megatron.checkpoint import describe_checkpoint, diff_checkpoints

    if args.verify:
        from megatron.checkpoint import CheckpointError, read_manifest, resolve_checkpoint_dir, verify_checkpoint

        directory = resolve_checkpoint_dir(args.dir)
        problem = verify_checkpoint(directory, checksums=True)
        if problem:
            raise CheckpointError(problem)
        if read_manifest(directory) is None:
            raise CheckpointError(f"{directory} has no manifest.json to verify against")
        print(f"{directory}: every file matches its size and sha256 in manifest.json")
        return 0
    if args.diff is None:
        print("\n".join(describe_checkpoint(args.dir, args.attributes)))
        return 0
    lines = diff_checkpoints(args.dir, args.diff, args.config_file, args.atol)
    print("\n".join(lines) if lines else "checkpoints are identical")
    return 2 if lines else 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
