"""Which checkpoint a load resumes from: ``load: auto``, a missing ``load`` folder, ``iteration: N`` or
``latest`` (falling back to the newest valid checkpoint, ``megatron.checkpoint.commit``), and the manifest check."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from megatron import mpu
from megatron.checkpoint import commit as commit_lib
from megatron.checkpoint.layout import CheckpointError, checkpoint_folder, read_latest
from megatron.checkpoint.manifest import verify_checkpoint
from megatron.checkpoint.run_config import AUTO, CheckpointConfig
from megatron.checkpoint.tags import checkpoint_dirs, checkpoint_tag

logger = logging.getLogger(__name__)


def resolve_tag(cfg: CheckpointConfig) -> str | None:
    """The tag to load: ``global_step<iteration>`` if requested, else ``latest``'s content, else None."""
    assert cfg.load is not None
    root = Path(cfg.load)
    if cfg.iteration is not None:
        tag = checkpoint_tag(int(cfg.iteration))
        if not (root / tag).is_dir():
            available = ", ".join(p.name for p in checkpoint_dirs(root)) or "none"
            raise CheckpointError(f"iteration {cfg.iteration}: no checkpoint {root / tag} (available: {available})")
        checkpoint_folder(root, tag, f"iteration {cfg.iteration}")
        verify_manifest(root / tag, checksums=cfg.load_verify_checksums)
        return tag
    named = read_latest(root)  # '.', '..', separators or a symlink out: one line before anything is read
    picked = commit_lib.select_checkpoint(root, checksums=cfg.load_verify_checksums)
    if picked is not None:  # also a folder picked without (or instead of) latest's must stay inside load
        what = f"{root / 'latest'}" if picked == named else f"the newest checkpoint in {root}"
        checkpoint_folder(root, picked, what)
    return picked


def verify_manifest(directory: Path, *, checksums: bool = False) -> None:
    """A checkpoint with our manifest must hold every file it lists at the recorded size, and with ``checksums``
    its sha256 (GPT-NeoX checkpoints have no manifest)."""
    problem = verify_checkpoint(directory, checksums=checksums)
    if problem:
        raise CheckpointError(f"checkpoint {directory} is incomplete: {problem}")


def resolve_load_dir(cfg: CheckpointConfig) -> CheckpointConfig:
    """``load: auto`` means ``save``; a missing ``load`` folder is an error unless it is ``save`` (auto-resume)."""
    load = cfg.load
    if load == AUTO:
        if not cfg.save:
            raise CheckpointError("load: auto resumes from the save directory, but save is not set")
        load = cfg.save
    assert load is not None
    if Path(load).is_dir():
        return dataclasses.replace(cfg, load=load)
    if cfg.load == AUTO or (cfg.save and Path(load).resolve() == Path(cfg.save).resolve()):
        if mpu.world_rank() == 0:
            logger.info("auto-resume: %s holds no checkpoint yet, starting from iteration 0", load)
        return dataclasses.replace(cfg, load=None)
    raise CheckpointError(
        f"load directory {load} does not exist; check the path, or set load equal to save (or load: auto) to "
        "resume when a checkpoint exists and start fresh otherwise"
    )
