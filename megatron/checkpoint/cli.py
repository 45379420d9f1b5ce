"""Shared glue of the ``tools/ckpts`` entry points: logging, progress bars, the error → exit-code rule and the
command-line preamble (``--trust-checkpoint`` and ``--quiet`` added and honoured, an existing ``--output_dir``
refused unless ``--overwrite``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import yaml

from megatron.checkpoint.layout import CheckpointError, detect_layout, resolve_checkpoint_dir
from megatron.checkpoint.safe_load import trust_checkpoints
from megatron.logging.progress import add_quiet_flag, progress, set_quiet
from megatron.neox_arguments import KNOWN_KEYS
from megatron.neox_arguments.loader import apply_overrides, merge_config_files


def setup_logging() -> None:
    """INFO to stderr, DeepSpeed/transformers quiet."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("DeepSpeed", "deepspeed", "transformers", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def progress_bar(desc: str, total: int | None = None) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (terminal only, not under ``--quiet``); yields ``step(name)`` that advances it."""
    with progress(desc=desc, total=total, unit="item") as bar:

        def step(name: str) -> None:
            bar.set_postfix_str(name[-40:], refresh=False)
            bar.update(1)

        yield step


def shard_count(path: str, iteration: int | None = None) -> int | None:
    """Number of shard files a read of ``path`` goes through (for a progress bar total), None if unknown."""
    try:
        layout = detect_layout(resolve_checkpoint_dir(path, iteration))
    except (CheckpointError, OSError):
        return None  # the read itself reports the problem
    if layout.zero3_files:
        return layout.tp
    return sum(len(files) for files in layout.layer_files.values()) if layout.is_pipe else len(layout.mp_files)


def add_trust_flag(parser: argparse.ArgumentParser) -> None:
    """``--trust-checkpoint``: the escape hatch from ``weights_only`` loading (see ``megatron.checkpoint.safe_load``)."""
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="fully unpickle checkpoint files (can run code: only for files you trust); default: weights_only loading",
    )


def apply_trust_flag(args: argparse.Namespace) -> None:
    """Honour ``--trust-checkpoint`` for this process (logged as a warning)."""
    if getattr(args, "trust_checkpoint", False):
        trust_checkpoints()


def run(main: Callable[[], int]) -> int:
    """Run an entry point: user mistakes (ValueError, CheckpointError, missing files) → message and exit code 1."""
    setup_logging()
    try:
        return main()
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1


def merged_config_file(config_files: list[str], overrides: dict[str, Any], directory: str) -> str:
    """``config_files`` merged with ``overrides`` over them (GPT-NeoX's ``overwrite_values``), written as one YAML
    file in ``directory``; returns its path. Unknown keys raise ``ConfigError`` (a ``ValueError``)."""
    merged = merge_config_files(list(config_files), KNOWN_KEYS)
    apply_overrides(merged, overrides, KNOWN_KEYS, "overwrite_values")
    path = os.path.join(directory, "merged_config.yml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(merged.values, f, sort_keys=True)
    return path


def parse_tool_args(parser: argparse.ArgumentParser, argv: list[str] | None, quiet: bool = True) -> argparse.Namespace:
    """Add ``--trust-checkpoint`` (and ``--quiet`` unless ``quiet=False``) to ``parser``, then parse ``argv``."""
    add_trust_flag(parser)
    if quiet:
        add_quiet_flag(parser)
    return parser.parse_args(argv)


def apply_tool_args(args: argparse.Namespace) -> None:
    """Honour ``--trust-checkpoint`` and ``--quiet`` (where the tool has it) for this process."""
    apply_trust_flag(args)
    if hasattr(args, "quiet"):
        set_quiet(args.quiet)


def refuse_existing_output_dir(args: argparse.Namespace) -> None:
    """``ValueError`` when ``--output_dir`` exists and ``--overwrite`` is not given."""
    if os.path.exists(args.output_dir) and not args.overwrite:
        raise ValueError(f"--output_dir {args.output_dir} already exists (pass --overwrite to replace it)")
