"""Rewrite a GPT-NeoX checkpoint for another tensor/pipeline-parallel layout.

    python tools/ckpts/reshard_checkpoint.py --input_dir ckpts --output_dir ckpts_tp1 --tp 1 --pp 1

Weights are always resharded; ZeRO-0 optimizer state (a torch optimizer state dict per mp_rank file) is resharded
with them, otherwise the output is weights-only (load it with ``no_load_optim: true`` or ``finetune: true``).
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
    p.add_argument("--output_dir", required=True, help="checkpoint root to create")
    p.add_argument("--tp", type=int, required=True, help="target model_parallel_size")
    p.add_argument("--pp", type=int, required=True, help="target pipe_parallel_size (0 = sequential files)")
    p.add_argument("--config_file", nargs="*", default=None, help="GPT-NeoX YAML(s); default: the checkpoint's")
    p.add_argument("--iteration", type=int, default=None, help="which global_stepN (default: 'latest')")
    p.add_argument("--padded_vocab_size", type=int, default=None, help="target vocabulary rows (pad/trim)")
    p.add_argument("--weights_only", action="store_true", help="drop the optimizer state")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_dir")
    return cli.parse_tool_args(p, argv)


def main(argv: list[str] | None = None) -> int:
    """Reshard; returns the exit code."""
    args = parse_args(argv)
    cli.apply_tool_args(args)
    from megatron.checkpoint import TargetLayout, reshard_checkpoint

    target = TargetLayout(tp=args.tp, pp=args.pp)
    cli.refuse_existing_output_dir(args)
    with cli.progress_bar("resharding") as step:
        result = reshard_checkpoint(
            args.input_dir,
            args.output_dir,
            target,
            config_files=args.config_file,
            iteration=args.iteration,
            padded_vocab_size=args.padded_vocab_size,
            weights_only=args.weights_only,
            overwrite=args.overwrite,
            progress=step,
        )
    state = "with optimizer state" if result.optimizer_resharded else "WEIGHTS ONLY"
    state += f"; {result.note}" if result.note else ""
    print(f"resharded {result.source} -> tp={target.tp} pp={target.pp} at {result.directory} ({state})")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
