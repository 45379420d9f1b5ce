"""The model configuration of a checkpoint: from GPT-NeoX YAML files or from the checkpoint's own ``configs/``."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megatron.checkpoint.layout import CheckpointError
from megatron.model.config import GPTModelConfig

logger = logging.getLogger(__name__)

RESOLVED = "resolved_config.json"


def load_neox_args(config_files: Sequence[str | Path]) -> SimpleNamespace:
    """GPT-NeoX keys (defaults + the files, merged with GPT-NeoX's rules; unknown keys are errors).

    Unlike ``NeoXArgs.from_ymls`` nothing is checked against a launch (world size, data paths, ``seq_length``):
    offline tools read model configs on one process. The model keys are validated by ``GPTModelConfig``.
    """
    from megatron.neox_arguments import KNOWN_KEYS, default_values
    from megatron.neox_arguments.loader import merge_config_files

    for path in config_files:
        if not Path(path).is_file():
            raise CheckpointError(f"config file {path} does not exist")
    merged = merge_config_files([str(p) for p in config_files], KNOWN_KEYS)
    return SimpleNamespace(**{**default_values(), **merged.values})


def checkpoint_config_args(directory: str | Path) -> Any | None:
    """The resolved config saved with a checkpoint (``configs/resolved_config.json`` or its YAML files), or None."""
    configs = Path(directory) / "configs"
    resolved = configs / RESOLVED
    if resolved.is_file():
        return SimpleNamespace(**json.loads(resolved.read_text()))
    ymls = sorted(p for p in configs.glob("*") if p.suffix in (".yml", ".yaml", ".json")) if configs.is_dir() else []
    if ymls:
        try:
            return load_neox_args(ymls)
        except ValueError as e:
            logger.warning("could not read the configs saved in %s: %s", configs, e)
    return None


def config_files_text(directory: str | Path) -> dict[str, str]:
    """``{basename: text}`` of every file under ``<checkpoint>/configs`` (copied along when resharding)."""
    configs = Path(directory) / "configs"
    if not configs.is_dir():
        return {}
    return {p.name: p.read_text() for p in sorted(configs.iterdir()) if p.is_file()}


def model_config(args: Any, padded_vocab_size: int | None = None) -> GPTModelConfig:
    """``GPTModelConfig`` for ``args`` (GPT-NeoX attribute names); ``padded_vocab_size`` overrides the config's."""
    if padded_vocab_size is not None:
        values = dict(vars(args)) if isinstance(args, SimpleNamespace) else None
        if values is not None:
            values["padded_vocab_size"] = padded_vocab_size
            args = SimpleNamespace(**values)
        else:
            args = _Override(args, padded_vocab_size=padded_vocab_size)
    return GPTModelConfig.from_neox_args(args)


class _Override:
    """Attribute view of ``base`` with a few values replaced."""

    def __init__(self, base: Any, **values: Any) -> None:
        self._base, self._values = base, values

    def __getattr__(self, name: str) -> Any:
        if name in self._values:
            return self._values[name]
        return getattr(self._base, name)


def parallel_sizes(args: Any) -> tuple[int, int]:
    """``(model_parallel_size, pipe_parallel_size)`` of a config (defaults 1, 1 like GPT-NeoX)."""
    tp = getattr(args, "model_parallel_size", None)
    pp = getattr(args, "pipe_parallel_size", None)
    return int(tp if tp is not None else 1), int(pp if pp is not None else 1)
