"""Would a resume from this checkpoint folder pass the load checks? Read from the files, for retention: before
``keep_last_n_checkpoints`` deletes older checkpoints, the new one must be one a run can resume from.

The checks are a resume's, on what is on disk: the manifest (structure, every file at its recorded size) and every
tensor of every ``*.pt`` file finite — weights, optimizer moments, fp32 master partitions alike. The files are
memory-mapped (``torch.load(mmap=True)``, no copy); each floating tensor costs one fp32 sum
(``megatron.checkpoint.finite``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.finite import nonfinite_message, nonfinite_tensor
from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.manifest import verify_checkpoint
from megatron.checkpoint.reader import load_torch

MAX_DEPTH = 32  # nesting of the containers a checkpoint file holds (DeepSpeed's go about 6 deep)


def named_tensors(obj: Any, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts / lists / tuples, named by its path of keys (``optimizer.state.3.exp_avg``)."""
    if torch.is_tensor(obj):
        yield prefix, obj
        return
    if depth >= MAX_DEPTH:
        return
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return
    for key, value in items:
        yield from named_tensors(value, f"{prefix}.{key}" if prefix else str(key), depth + 1)


def nonfinite_file_problem(path: Path) -> str | None:
    """One line naming ``path`` and its first tensor holding NaN/inf (None: every tensor is finite)."""
    found = nonfinite_tensor(named_tensors(load_torch(path, mmap=True)))
    return None if found is None else nonfinite_message(path, found)


def load_problem(directory: Path) -> str | None:
    """Why a resume from ``directory`` would be refused (a one-line reason naming the file), None when it passes."""
    problem = verify_checkpoint(directory)
    if problem is not None:
        return problem
    for path in sorted(directory.glob("*.pt")):
        try:
            problem = nonfinite_file_problem(path)
        except CheckpointError as e:
            problem = str(e)
        if problem is not None:
            return problem
    return None
