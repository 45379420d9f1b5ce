"""Describe a checkpoint (layout, iteration, args, every tensor) and diff two checkpoints tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.layout import CheckpointError, detect_layout, resolve_checkpoint_dir
from megatron.checkpoint.reader import ENGINE_KEYS, load_torch, read_checkpoint

SKIP_CLIENT = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}.{i}" if prefix else str(i))


def describe_file(path: str | Path) -> list[str]:
    """One line per tensor of a ``.pt`` file (nested keys joined with dots), then its scalar entries."""
    obj = load_torch(Path(path))
    lines = [f"{name}  {tuple(t.shape)}  {str(t.dtype).removeprefix('torch.')}" for name, t in _tensors(obj)]
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key not in (*ENGINE_KEYS, *SKIP_CLIENT) and not torch.is_tensor(value):
                lines.append(f"{key} = {value!r}"[:300])
    return lines


def describe_checkpoint(path: str | Path, attributes: list[str] | None = None) -> list[str]:
    """Layout, iteration, saved args and the tensors of every file (``attributes`` filters tensor names)."""
    target = Path(path)
    if target.is_file():
        lines = describe_file(target)
        return [ln for ln in lines if not attributes or any(a in ln for a in attributes)]
    directory = resolve_checkpoint_dir(target)
    layout = detect_layout(directory)
    lines = [f"checkpoint {directory}", f"layout {layout.describe()}"]
    if layout.mp_files:
        engine = load_torch(layout.mp_files[0])
        lines.append(f"iteration {engine.get('iteration', engine.get('global_steps'))}")
        lines.append(f"args {engine.get('args')}")
        opt = engine.get("optimizer")
        lines.append(f"optimizer state {'none' if opt is None else type(opt).__name__}")
    configs = directory / "configs"
    if configs.is_dir():
        lines.append(f"configs {', '.join(sorted(p.name for p in configs.iterdir()))}")
    files = layout.mp_files if not layout.is_pipe else [p for files in layout.layer_files.values() for p in files]
    for file in files:
        lines.append(f"== {file.name}")
        for line in describe_file(file):
            if "=" in line and not attributes:
                continue  # engine scalars already summarised above
            if not attributes or any(a in line for a in attributes):
                lines.append(f"  {line}")
    return lines


def diff_checkpoints(
    a: str | Path, b: str | Path, config_files: list[str | Path] | None = None, atol: float = 0.0
) -> list[str]:
    """Differences between two checkpoints of any layouts, compared as merged full state dicts (empty: equal)."""
    ca = read_checkpoint(a, config_files=config_files)
    cb = read_checkpoint(b, config_files=config_files)
    out = []
    for key in sorted(set(ca.state_dict) | set(cb.state_dict)):
        if key not in cb.state_dict or key not in ca.state_dict:
            out.append(f"{key}: only in {'A' if key in ca.state_dict else 'B'}")
            continue
        ta, tb = ca.state_dict[key], cb.state_dict[key]
        if ta.shape != tb.shape:
            out.append(f"{key}: shape {tuple(ta.shape)} vs {tuple(tb.shape)}")
            continue
        diff = (ta.float() - tb.float()).abs().max().item() if ta.numel() else 0.0
        if diff > atol or ta.dtype != tb.dtype:
            out.append(f"{key}: max abs diff {diff:.3g} ({ta.dtype} vs {tb.dtype})")
    if ca.iteration != cb.iteration:
        out.append(f"iteration: {ca.iteration} vs {cb.iteration}")
    return out


__all__ = ["CheckpointError", "describe_checkpoint", "describe_file", "diff_checkpoints"]
