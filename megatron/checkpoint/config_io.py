"""The model configuration of a checkpoint: from GPT-NeoX YAML files or from the checkpoint's own ``configs/``."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megatron.checkpoint.layout import CheckpointError
from megatron.model.config import GPTModelConfig
from megatron.neox_arguments import KNOWN_KEYS, ConfigError, LaunchEnv, default_values
from megatron.neox_arguments.derive import derive
from megatron.neox_arguments.loader import merge_config_files
from megatron.neox_arguments.validate import model_problems

logger = logging.getLogger(__name__)

RESOLVED = "resolved_config.json"


def load_neox_args(config_files: Sequence[str | Path]) -> SimpleNamespace:
    """GPT-NeoX keys (defaults + the files, merged with GPT-NeoX's rules; unknown keys are errors).

    Unlike ``NeoXArgs.from_ymls`` nothing is checked against a launch (world size, data paths, ``seq_length``):
    offline tools read model configs on one process. The model keys are validated by ``GPTModelConfig``.
    """
    for path in config_files:
        if not Path(path).is_file():
            raise CheckpointError(f"config file {path} does not exist")
    merged = merge_config_files([str(p) for p in config_files], KNOWN_KEYS)
    return _with_derived(merged.values)


def _with_derived(values: dict[str, Any]) -> SimpleNamespace:
    """Defaults, then ``values``, then the derived keys (``precision`` from the fp16/bf16 sections, the expanded
    ``attention_config`` ...) as ``NeoXArgs`` resolves them (``derive()``); launch problems are not an offline
    reader's."""
    resolved = {**default_values(), **values}
    updates, _ = derive(resolved, set(values), LaunchEnv())
    resolved.update(updates)
    return SimpleNamespace(**resolved)


def checkpoint_config_args(directory: str | Path) -> SimpleNamespace | None:
    """The resolved config saved with a checkpoint (``configs/resolved_config.json`` or its YAML files), or None.

    Keys a ``resolved_config.json`` of an older version lacks get their defaults, so every key can be read strictly.
    """
    configs = Path(directory) / "configs"
    resolved = configs / RESOLVED
    if resolved.is_file():
        try:
            values = json.loads(resolved.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise CheckpointError(f"cannot read {resolved} ({type(e).__name__}: {e})") from None
        if not isinstance(values, dict):
            raise CheckpointError(f"{resolved} holds a JSON {type(values).__name__}, expected an object of config keys")
        return _with_derived(values)
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


def model_config(config: SimpleNamespace, padded_vocab_size: int) -> GPTModelConfig:
    """``GPTModelConfig`` for ``config`` (every GPT-NeoX key, see :func:`load_neox_args`) with ``padded_vocab_size``;
    the config layer's model rules (ranges, heads, layers) refuse a bad shape first (``ConfigError``)."""
    values = {**vars(config), "padded_vocab_size": padded_vocab_size}
    problems = model_problems(values, {f.name for f in dataclasses.fields(GPTModelConfig)})
    if problems:
        raise ConfigError(problems)
    return GPTModelConfig.from_neox_args(SimpleNamespace(**values))
