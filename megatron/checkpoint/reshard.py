"""Any (tp, pp) → any (tp, pp): weights always, the optimizer state (in ZeRO-0 form) when the source has it."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.optimizer_state import (
    FullOptimizerState,
    gather_optimizer_state,
    resize_optimizer_vocab,
    scatter_optimizer_state,
)
from megatron.checkpoint.reader import NeoXCheckpoint, load_torch, read_checkpoint
from megatron.checkpoint.rules import resize_vocab, split_tensor
from megatron.checkpoint.structure import checkpoint_structure
from megatron.checkpoint.writer import TargetLayout, write_checkpoint
from megatron.checkpoint.zero_state import ZERO_OPTIM_RE, gather_zero_optimizer_state
from megatron.model.config import GPTModelConfig, pad_vocab_size

logger = logging.getLogger(__name__)

RNG_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")
WEIGHTS_ONLY_KEY = "weights_only"
DROPPED_KEY = "optimizer_state_not_carried"


@dataclass
class ReshardResult:
    """What :func:`reshard_checkpoint` wrote."""

    directory: Path
    source: str
    target: TargetLayout
    optimizer_resharded: bool
    padded_vocab_size: int
    note: str = ""


def target_vocab(ckpt: NeoXCheckpoint, tp: int, padded_vocab_size: int | None) -> int:
    """Padded vocabulary rows for the target: as given, else kept when ``tp`` divides it, else padded up."""
    current = ckpt.cfg.vocab_rows
    if padded_vocab_size is not None:
        if padded_vocab_size % tp:
            raise CheckpointError(f"padded_vocab_size={padded_vocab_size} is not divisible by tp={tp}")
        return padded_vocab_size
    if current % tp == 0:
        return current
    divisible = int((ckpt.client_state.get("args") or {}).get("make_vocab_size_divisible_by") or 128)
    rows = pad_vocab_size(current, divisible, tp)
    logger.warning("padded vocabulary %d is not divisible by tp=%d: padding to %d rows", current, tp, rows)
    return rows


def gather_full_optimizer_state(ckpt: NeoXCheckpoint) -> tuple[FullOptimizerState, bool]:
    """The per-parameter optimizer state of ``ckpt`` (ZeRO-0 torch state, else ZeRO-1/2/3 or bf16-optimizer shards)
    and whether it came from ZeRO shards; a ``CheckpointError`` saying why when it has none that can be carried."""
    layout, cfg = ckpt.layout, ckpt.cfg
    with checkpoint_structure(layout.directory):
        optimizers = [_optimizer_entry(p) for p in layout.mp_files]
        src_tp, src_pp = layout.tp, layout.pp if layout.is_pipe else 0
        src_shard = {k: tuple(split_tensor(k, v, cfg, src_tp)[0].shape) for k, v in ckpt.state_dict.items()}
        try:
            return gather_optimizer_state(optimizers, lambda name, _tp: src_shard[name], cfg, src_tp, src_pp), False
        except CheckpointError as plain:
            try:
                full = gather_zero_optimizer_state(layout.directory, cfg, src_tp, lambda name, _tp: src_shard[name])
            except CheckpointError as zero:
                raise CheckpointError(f"{plain}; {zero}") from None
            return full, True


def _optimizer_entry(path: Path) -> Any:
    """The ``optimizer`` entry of a model-states file (None when it has none)."""
    state = load_torch(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a DeepSpeed model-states dict")
    return state.get("optimizer")


def _has_optimizer_state(ckpt: NeoXCheckpoint) -> bool:
    """True when the checkpoint holds optimizer state of any kind (a converted HF model holds none)."""
    layout = ckpt.layout
    if layout.zero3_files or any(ZERO_OPTIM_RE.match(p.name) for p in layout.directory.iterdir()):
        return True
    return any(load_torch(p).get("optimizer") for p in layout.mp_files)


def _optimizer_fn(
    ckpt: NeoXCheckpoint, target: TargetLayout, rows: int
) -> tuple[Callable[[int, int], dict[str, Any]] | None, str]:
    cfg = ckpt.cfg
    try:
        full, from_zero = gather_full_optimizer_state(ckpt)
    except CheckpointError as e:
        return None, f"optimizer state not resharded ({e}); the output is weights-only"
    note = (
        "ZeRO optimizer state written in ZeRO-0 form (a ZeRO-1/2 or bf16 run carries it over on load)"
        if from_zero
        else ""
    )
    resize_optimizer_vocab(full, rows)
    new_cfg = cfg.replace(padded_vocab_size=rows)
    return scatter_optimizer_state(full, new_cfg, target.tp, target.pp), note


def reshard_checkpoint(
    src: str | Path,
    dst: str | Path,
    target: TargetLayout,
    *,
    model: GPTModelConfig | None = None,
    config_files: list[str | Path] | None = None,
    iteration: int | None = None,
    padded_vocab_size: int | None = None,
    weights_only: bool = False,
    weights_only_fallback: bool = False,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ReshardResult:
    """Rewrite the checkpoint ``src`` (root or ``global_stepN``) as ``dst/global_stepN`` in the ``target`` layout.

    When the optimizer state cannot be carried (e.g. a ZeRO-0 fp16/bf16 wrapper's) this is an error naming why, unless
    ``weights_only`` asks for the weights alone or ``weights_only_fallback`` accepts a weights-only copy (marked
    as such; loading it with optimizer state is refused later)."""
    ckpt = read_checkpoint(src, model=model, config_files=config_files, iteration=iteration, progress=progress)
    rows = target_vocab(ckpt, target.tp, padded_vocab_size)
    cfg = ckpt.cfg.replace(padded_vocab_size=rows)
    state = {k: resize_vocab(k, v, rows) for k, v in ckpt.state_dict.items()}
    optimizer_fn, note = (None, "weights-only as requested") if weights_only else _optimizer_fn(ckpt, target, rows)
    dropped = optimizer_fn is None and not weights_only and _has_optimizer_state(ckpt)
    if dropped and not weights_only_fallback:
        raise CheckpointError(
            f"{ckpt.layout.directory}: {note.removesuffix('; the output is weights-only')}; the optimizer state of "
            "this checkpoint cannot be resharded: pass --weights_only to reshard the weights "
            "alone (a resumed run then needs no_load_optim: true)"
        )
    if note:
        logger.warning("%s", note)
    client = dict(ckpt.client_state)
    client[WEIGHTS_ONLY_KEY] = optimizer_fn is None
    client[DROPPED_KEY] = dropped  # the source had optimizer state this copy lacks
    client["resharded_from"] = {"tp": ckpt.layout.tp, "pp": ckpt.layout.pp if ckpt.layout.is_pipe else 0}
    per_tp_rng = []
    for tp_rank in range(ckpt.layout.tp):
        if tp_rank < len(ckpt.layout.mp_files):
            engine = load_torch(ckpt.layout.mp_files[tp_rank])
            per_tp_rng.append({k: engine[k] for k in RNG_KEYS if k in engine})
    configs = dict(ckpt.config_files)
    if "resolved_config.json" in configs:  # keep the saved config truthful about the new layout
        resolved = json.loads(configs["resolved_config.json"])
        resolved.update(model_parallel_size=target.tp, pipe_parallel_size=target.pp, padded_vocab_size=rows)
        configs["resolved_config.json"] = json.dumps(resolved, indent=2, sort_keys=True)
    directory = write_checkpoint(
        state,
        cfg,
        dst,
        target,
        iteration=ckpt.iteration,
        client_state=client,
        rank_client_state=(lambda t: per_tp_rng[t % len(per_tp_rng)]) if per_tp_rng else None,
        optimizer_state=optimizer_fn,
        config_files=configs,
        overwrite=overwrite,
        progress=progress,
    )
    source = ckpt.layout.describe()
    logger.info("resharded %s %s -> tp=%d pp=%d at %s", ckpt.layout.directory, source, target.tp, target.pp, dst)
    return ReshardResult(directory, source, target, optimizer_fn is not None, rows, note)
