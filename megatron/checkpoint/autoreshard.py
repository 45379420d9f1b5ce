"""Load-time resharding: when ``load`` meets a checkpoint of another (tp, pp) layout, rewrite it for the current one.

Rank 0 writes the resharded copy next to the checkpoint (``<root>/.resharded/<tag>-tp<T>-pp<P>``, reused when it
is already there), every rank then loads that copy. The optimizer state comes along in ZeRO-0 form (from ZeRO-0 torch
state, ZeRO-1/2/3 or bf16-optimizer shards; ``optimizer_carry`` writes it into a ZeRO-1/2/3 or bf16 run); when it
cannot be gathered the copy is weights-only, and the caller refuses it unless the run loads no optimizer state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron import mpu
from megatron.checkpoint.layout import CheckpointError, detect_layout
from megatron.checkpoint.manifest import MANIFEST
from megatron.checkpoint.reader import engine_state, is_neox_forge, load_torch
from megatron.checkpoint.reshard import DROPPED_KEY, WEIGHTS_ONLY_KEY, reshard_checkpoint
from megatron.checkpoint.writer import TargetLayout
from megatron.engine_protocol import Engine
from megatron.model.config import GPTModelConfig

logger = logging.getLogger(__name__)

RESHARD_DIR = ".resharded"


@dataclass
class LoadPlan:
    """Where to load from: ``root``/``tag`` (the original or a resharded copy) and whether it is weights-only."""

    root: str
    tag: str
    resharded: bool = False
    weights_only: bool = False
    optimizer_dropped: bool = False  # the source had optimizer state the (weights-only) copy lacks


def _fresh_copy(manifest: Path, source: Path) -> bool:
    """A resharded copy exists and is newer than every file of its source (a re-saved tag invalidates it)."""
    if not manifest.is_file():
        return False
    newest = max((p.stat().st_mtime for p in source.rglob("*") if p.is_file()), default=0.0)
    return manifest.stat().st_mtime >= newest


def _weights_only(directory: Path) -> tuple[bool, bool]:
    state = load_torch(directory / "mp_rank_00_model_states.pt")
    return bool(state.get(WEIGHTS_ONLY_KEY, False)), bool(state.get(DROPPED_KEY, False))


def plan_load(
    root: str | Path,
    tag: str,
    *,
    tp: int,
    pp: int,
    model: GPTModelConfig,
    is_writer: bool,
    barrier: Callable[[], None],
    reads_zero3: bool = True,
) -> LoadPlan:
    """Decide where to load ``root/tag`` from for the current ``(tp, pp)``; reshard (on the writer rank) if needed.

    ``pp`` is ``pipe_parallel_size`` (0 = sequential model); ``model`` is this run's model config (a resharded copy
    gets its padded vocabulary).
    A resharded copy holds ZeRO-0 optimizer state (ZeRO-1/2/3 and bf16 runs carry it over: ``optimizer_carry``).
    ``reads_zero3`` is False for a run that is not ZeRO-3: DeepSpeed then cannot read a ZeRO-3 checkpoint's weights
    (they live in the ZeRO-3 shards), so one is rewritten in ZeRO-0 form even at the same layout.
    Every rank must call this (it contains a barrier when resharding).
    """
    directory = Path(root) / tag
    layout = detect_layout(directory)
    src = (layout.tp, layout.pp if layout.is_pipe else 0)
    # A GPT-NeoX-written parallel-residual checkpoint stores row-parallel biases per TP rank (effective = sum).
    gpt_neox_biases = layout.tp > 1 and model.gpt_j_residual and not is_neox_forge(layout, engine_state(layout))
    zero3_to_other = bool(layout.zero3_files) and not reads_zero3
    if src == (tp, pp) and not gpt_neox_biases and not zero3_to_other:
        return LoadPlan(str(root), tag)
    out_root = Path(root) / RESHARD_DIR / f"{tag}-tp{tp}-pp{pp}"
    if src == (tp, pp) and zero3_to_other:
        logger.warning(
            "checkpoint %s is ZeRO-3 and this run is not: rewriting it in ZeRO-0 form into %s", directory, out_root
        )
    elif src == (tp, pp):
        logger.warning(
            "checkpoint %s was written by GPT-NeoX: converting its row-parallel biases into %s", directory, out_root
        )
    else:
        logger.warning(
            "checkpoint %s was saved with tp=%d pp=%d but this run uses tp=%d pp=%d: resharding it into %s",
            directory,
            src[0],
            src[1],
            tp,
            pp,
            out_root,
        )
    error: Exception | None = None
    if is_writer and not _fresh_copy(out_root / tag / MANIFEST, directory):
        try:
            reshard_checkpoint(
                directory,
                out_root,
                TargetLayout(tp=tp, pp=pp),
                model=model,
                padded_vocab_size=model.padded_vocab_size,
                overwrite=True,
                weights_only_fallback=True,
            )
        except Exception as e:  # any failure must still reach the barrier, or the other ranks would hang
            error = e
    barrier()
    if error is not None:
        raise CheckpointError(f"automatic resharding of {directory} failed: {error}") from error
    if not (out_root / tag / MANIFEST).is_file():
        raise CheckpointError(f"automatic resharding of {directory} produced no checkpoint at {out_root / tag}")
    weights_only, dropped = _weights_only(out_root / tag)  # dropped: refused unless the run loads no optimizer state
    return LoadPlan(str(out_root), tag, resharded=True, weights_only=weights_only, optimizer_dropped=dropped)


def plan_load_for_engine(engine: Engine, root: str | Path, tag: str, *, model: GPTModelConfig) -> LoadPlan:
    """:func:`plan_load` for a DeepSpeed ``engine`` of this run (layout from ``megatron.mpu`` and the module type)."""
    from deepspeed.pipe import PipelineModule

    tp = mpu.get_model_parallel_world_size()
    pp = mpu.get_pipe_parallel_world_size() if isinstance(getattr(engine, "module", None), PipelineModule) else 0
    return plan_load(
        root,
        tag,
        tp=tp,
        pp=pp,
        model=model,
        is_writer=mpu.world_rank() == 0,
        barrier=mpu.barrier,
        reads_zero3=int(engine.zero_optimization_stage()) >= 3 if hasattr(engine, "zero_optimization_stage") else False,
    )
