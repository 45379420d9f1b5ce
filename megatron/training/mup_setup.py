"""The training side of muP (``megatron/model/mup.py``): GPT-NeoX's ``save_base_shapes`` (write the base shapes of
the configured model and of its delta, ``hidden_size · mup_width_scale``, then stop) and reading them back for
the run (``base_shapes_file``), one file per rank: ``{base_shapes_file}.{rank}``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from megatron.model.config import GPTModelConfig
from megatron.model.mup import (
    BaseShapes,
    MupConfig,
    MupShapes,
    apply_mup,
    make_base_shapes,
    read_base_shapes,
    shapes_of,
)
from megatron.model.mup import write_base_shapes as write_file

logger = logging.getLogger(__name__)


def base_shapes_for(
    model_cfg: GPTModelConfig, cfg: MupConfig, build: Callable[[GPTModelConfig], torch.nn.Module], on_meta: bool
) -> BaseShapes:
    """The base shapes of ``build(model_cfg)``: base and delta models built on the meta device (nothing allocated)
    where ``on_meta``; DeepSpeed's PipelineModule moves itself to the device, so pipeline models are built for real
    (one after the other, as GPT-NeoX does)."""
    delta_cfg = model_cfg.replace(hidden_size=model_cfg.hidden_size * cfg.mup_width_scale)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        base = shapes_of(build(model_cfg))
        delta = shapes_of(build(delta_cfg))
    return make_base_shapes(base, delta)


def save_base_shapes(
    cfg: MupConfig,
    model_cfg: GPTModelConfig,
    build: Callable[[GPTModelConfig], torch.nn.Module],
    rank: int,
    on_meta: bool = True,
) -> Path:
    """Write this rank's base shapes file (GPT-NeoX's ``save_base_shapes``); returns its path."""
    path = cfg.rank_file(rank)
    write_file(path, base_shapes_for(model_cfg, cfg, build, on_meta))
    logger.info("saved muP base shapes to %s", path)
    return path


def prepare_mup(model: torch.nn.Module, cfg: MupConfig, model_cfg: GPTModelConfig, rank: int) -> MupShapes | None:
    """With ``use_mup``: read this rank's base shapes file and give ``model`` muP's init and readout multiplier;
    returns the shapes the optimizer splits its groups by (None without muP)."""
    if not cfg.use_mup:
        return None
    path = cfg.rank_file(rank)
    return apply_mup(model, cfg, model_cfg, read_base_shapes(path), str(path))
