"""The command-line preamble the checkpoint tools (``tools/ckpts``) share: ``--trust-checkpoint`` and ``--quiet``
added and honoured, and an existing ``--output_dir`` refused unless ``--overwrite``.

(It sits next to :mod:`megatron.checkpoint` rather than in ``megatron/checkpoint/cli.py`` only while that package
is being reorganised; it belongs there.)
"""

from __future__ import annotations

import argparse
import os

from megatron.checkpoint import cli
from megatron.logging.progress import add_quiet_flag, set_quiet


def parse_tool_args(parser: argparse.ArgumentParser, argv: list[str] | None, quiet: bool = True) -> argparse.Namespace:
    """Add ``--trust-checkpoint`` (and ``--quiet`` unless ``quiet=False``) to ``parser``, then parse ``argv``."""
    cli.add_trust_flag(parser)
    if quiet:
        add_quiet_flag(parser)
    return parser.parse_args(argv)


def apply_tool_args(args: argparse.Namespace) -> None:
    """Honour ``--trust-checkpoint`` and ``--quiet`` (where the tool has it) for this process."""
    cli.apply_trust_flag(args)
    if hasattr(args, "quiet"):
        set_quiet(args.quiet)


def refuse_existing_output_dir(args: argparse.Namespace) -> None:
    """``ValueError`` when ``--output_dir`` exists and ``--overwrite`` is not given."""
    if os.path.exists(args.output_dir) and not args.overwrite:
        raise ValueError(f"--output_dir {args.output_dir} already exists (pass --overwrite to replace it)")
