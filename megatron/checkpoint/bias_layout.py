"""Row-parallel biases on disk: what each TP rank's file holds, so GPT-NeoX's training and tools read our files.

In memory neox-forge's layers are TP-invariant: ``attention.dense.bias`` and ``mlp.linear2.bias`` hold the
effective bias, added once after the reduction. GPT-NeoX's parallel-residual layers (``gpt_j_residual``) add the
stored bias on every TP rank *before* their single reduction, so there the effective bias is the sum over ranks,
and GPT-NeoX's ``convert_neox_to_hf.py`` sums it. Checkpoints therefore have one of two layouts:

``split``
    each TP rank stores ``effective / tp`` (GPT-NeoX's parallel-residual training; what its converter expects).
``effective``
    each TP rank stores the effective bias (GPT-NeoX's sequential-residual training, every tp=1 checkpoint,
    ZeRO-3 checkpoints, and neox-forge checkpoints written before the layout was recorded).

Note: GPT-NeoX's ``convert_neox_to_hf.py`` sums row-parallel biases for sequential-residual models too, which
over-counts them ``tp`` times; its training code adds them once after the reduction. neox-forge follows the
training code (``effective``) and documents the converter's discrepancy in docs/checkpoints.md.

The layout is recorded in every checkpoint neox-forge writes, in the client state of each ``mp_rank_*`` file and in
``manifest.json`` (key ``row_parallel_bias``). A checkpoint without a manifest was written by GPT-NeoX.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROW_BIAS_KEY = "row_parallel_bias"
SPLIT = "split"
EFFECTIVE = "effective"
ROW_BIAS_MODULES = ("attention.dense", "mlp.linear2")


def written_layout(gpt_j_residual: bool, tp: int, zero_stage: int = 0) -> str:
    """The layout neox-forge writes: GPT-NeoX's (``split``) for parallel residual at tp > 1 outside ZeRO-3."""
    return SPLIT if gpt_j_residual and tp > 1 and zero_stage < 3 else EFFECTIVE


def stored_layout(directory: str | Path, *, gpt_j_residual: bool, tp: int, client_state: Any = None) -> str:
    """The layout of the checkpoint in ``directory`` (a ``global_stepN`` folder).

    Recorded layout (client state, then manifest) if any; a neox-forge checkpoint without a record is
    ``effective``; a GPT-NeoX checkpoint (no manifest) is ``split`` when parallel-residual at tp > 1.
    """
    if isinstance(client_state, dict) and client_state.get(ROW_BIAS_KEY) in (SPLIT, EFFECTIVE):
        return str(client_state[ROW_BIAS_KEY])
    manifest = Path(directory) / "manifest.json"
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text(encoding="utf-8")).get(ROW_BIAS_KEY)
        except (OSError, ValueError, AttributeError):
            recorded = None
        return recorded if recorded in (SPLIT, EFFECTIVE) else EFFECTIVE
    return SPLIT if gpt_j_residual and tp > 1 else EFFECTIVE


def is_row_bias(name: str) -> bool:
    return any(name.endswith(f"{module}.bias") for module in ROW_BIAS_MODULES)


def to_disk(value: torch.Tensor, layout: str, tp: int) -> torch.Tensor:
    """One rank's stored row-parallel bias for the in-memory (effective) ``value``."""
    return value / tp if layout == SPLIT else value


def from_disk(value: torch.Tensor, layout: str, tp: int) -> torch.Tensor:
    """The effective bias from one rank's stored value (ranks of a ``split`` checkpoint hold equal shares)."""
    return value * tp if layout == SPLIT else value


@contextmanager
def row_biases_on_disk(model: torch.nn.Module, layout: str, tp: int) -> Iterator[None]:
    """Within the block, ``state_dict()`` of ``model``'s row-parallel layers gives the ``layout``'s stored bias and
    ``load_state_dict()`` takes it (DeepSpeed's save/load of the engine's module, sequential or pipeline)."""
    if layout != SPLIT or tp == 1:
        yield
        return

    def save_hook(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if state_dict.get(prefix + "bias") is not None:
            state_dict[prefix + "bias"] = to_disk(state_dict[prefix + "bias"], layout, tp)

    def load_hook(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        if state_dict.get(prefix + "bias") is not None:
            state_dict[prefix + "bias"] = from_disk(state_dict[prefix + "bias"], layout, tp)

    handles = []
    for name, module in model.named_modules():
        if name.endswith(ROW_BIAS_MODULES) and getattr(module, "bias", None) is not None:
            handles.append(module.register_state_dict_post_hook(save_hook))
            handles.append(module.register_load_state_dict_pre_hook(load_hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
