"""Crash-safe checkpoint commit, choice of the checkpoint to load, and retention.

Save: every rank writes into ``<save>/.partial-global_step<N>``; rank 0 then fsyncs the files, writes the manifest
(sizes, sha256, iteration, consumed samples, layout, resolved config) last, renames the folder to
``global_step<N>`` and replaces ``latest`` atomically. A kill at any point leaves either the previous checkpoint
(and a ``.partial-*`` folder, removed by the next save or load) or the new one.

Load: the checkpoint ``latest`` names is used when its files have the sizes its manifest records; otherwise the
newest older valid checkpoint, with a warning naming the bad file. Retention deletes by iteration number and never
deletes the newest valid checkpoint nor the one ``latest`` names.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path

from megatron.checkpoint.layout import CheckpointError, read_latest
from megatron.checkpoint.loadable import load_problem
from megatron.checkpoint.manifest import atomic_write_text, fsync_path, verify_checkpoint
from megatron.checkpoint.tags import checkpoint_dirs, tag_iteration

logger = logging.getLogger(__name__)

PARTIAL_PREFIX = ".partial-"
TRASH_PREFIX = ".trash-"


def partial_tag(tag: str, run_id: str = "") -> str:
    """The folder name a checkpoint is written under before its commit (``run_id`` makes it this run's own)."""
    return f"{PARTIAL_PREFIX}{tag}-{run_id}" if run_id else f"{PARTIAL_PREFIX}{tag}"


def clean_partials(root: str | Path, run_id: str | None = None) -> list[Path]:
    """Remove folders of interrupted saves (``.partial-*``, ``.trash-*``); returns them.

    With ``run_id``, only that run's own folders: another run's save in progress is never touched. Without, every
    such folder (call it only while holding the save folder's lock, when no other run can be writing there).
    """
    base = Path(root)
    if not base.is_dir():
        return []
    doomed = [
        p
        for p in base.iterdir()
        if p.is_dir()
        and p.name.startswith((PARTIAL_PREFIX, TRASH_PREFIX))
        and (run_id is None or p.name.endswith(f"-{run_id}"))
    ]
    for path in doomed:
        logger.warning("removing %s left by an interrupted checkpoint save", path)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# torch.save reports a failed write (disk full, quota) as a RuntimeError from its zip writer, without the errno
_TORCH_WRITE_FAILURE = ("inline_container", "iostream error", "file write failed", "PytorchStreamWriter")


@contextlib.contextmanager
def write_errors(save: str, tag: str) -> Iterator[None]:
    """Turn a failed write of checkpoint ``tag`` (disk full, quota, read-only) into one CheckpointError line.

    What is on disk stays consistent: the previous checkpoint and ``latest`` are untouched, the partial folder is
    removed by the next save or load.
    """
    try:
        yield
    except (OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not any(m in str(e) for m in _TORCH_WRITE_FAILURE):
            raise
        try:
            free = shutil.disk_usage(save).free
        except OSError:
            free = -1
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            why = "no space left on device"
        elif isinstance(e, OSError):
            why = e.strerror or str(e)
        else:
            why = "write failed" + (", no space left on device" if 0 <= free < 1 << 20 else "")
        room = f"{free} bytes free there; " if free >= 0 else ""
        raise CheckpointError(
            f"save {save}: cannot write checkpoint {tag}: {why} ({room}the previous checkpoint and 'latest' are "
            "intact; free space or point save elsewhere, then restart to resume)"
        ) from None


def commit(root: str | Path, tag: str, run_id: str = "") -> Path:
    """Rank 0, after the manifest is written: rename the partial folder into place, then point ``latest`` at it."""
    base = Path(root)
    staged, final = base / partial_tag(tag, run_id), base / tag
    if final.exists():  # the same iteration saved again (e.g. a run resumed from an older step)
        trash = base / (f"{TRASH_PREFIX}{tag}-{run_id}" if run_id else f"{TRASH_PREFIX}{tag}")
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)
        staged.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staged.rename(final)
    fsync_path(base)
    atomic_write_text(base / "latest", tag)
    return final


def latest_tag(root: str | Path) -> str | None:
    """The tag ``root/latest`` names (one folder inside ``root``), None without a ``latest`` file."""
    return read_latest(root)


def select_checkpoint(root: str | Path, *, checksums: bool = False) -> str | None:
    """The tag to resume from: ``latest``'s if valid, else the newest older valid one (warning); None if none.
    Valid means every file has its manifest's size (and, with ``checksums``, its sha256)."""
    base = Path(root)
    tag = latest_tag(base)
    candidates = checkpoint_dirs(base)[::-1]
    if tag is not None:
        limit = tag_iteration(tag)
        older = [p for p in candidates if p.name != tag and (limit is None or (tag_iteration(p) or 0) < limit)]
        candidates = [base / tag, *older]
    for directory in candidates:
        problem = "it does not exist" if not directory.is_dir() else verify_checkpoint(directory, checksums=checksums)
        if problem is None:
            if directory.name != tag and tag is not None:
                logger.warning("loading %s instead of %s named by latest", directory, tag)
            return directory.name
        logger.warning("skipping checkpoint %s: %s", directory, problem)
    if tag is not None:
        raise CheckpointError(f"{base / 'latest'} names {tag!r}, and neither it nor an older checkpoint is valid")
    return None


def delete_old_checkpoints(
    save_dir: str | Path, keep_n: int, *, new: str | None = None, keep: Collection[str] = ()
) -> list[Path]:
    """Keep the newest ``keep_n`` checkpoints by iteration, plus the newest valid one, ``latest``'s and the tags in
    ``keep`` (those whose S3 upload has not ended); returns the deleted paths.

    ``new`` (the checkpoint just committed): before anything is deleted it must pass a resume's checks on its files
    (``megatron.checkpoint.loadable``); if it does not, nothing is deleted and a warning says why, so retention
    never removes the last checkpoint that loads.
    """
    if keep_n <= 0:
        return []
    checkpoints = checkpoint_dirs(save_dir)
    protected = {p.name for p in checkpoints[-keep_n:]}
    try:
        tag = latest_tag(save_dir)
    except CheckpointError:
        tag = None
    if tag:
        protected.add(tag)
    newest_valid = next((p for p in checkpoints[::-1] if verify_checkpoint(p) is None), None)
    if newest_valid is not None:
        protected.add(newest_valid.name)
    waiting = [p for p in checkpoints if p.name not in protected and p.name in keep]
    if waiting:
        logger.info("keep_last_n_checkpoints: keeping %s until its S3 upload ends", ", ".join(str(p) for p in waiting))
    doomed = [p for p in checkpoints if p.name not in protected and p.name not in keep]
    if doomed and new is not None:
        problem = load_problem(Path(save_dir) / new)
        if problem is not None:
            logger.warning(
                "keep_last_n_checkpoints: removing no checkpoint, since the new one %s would not load: %s",
                Path(save_dir) / new,
                problem,
            )
            return []
    for path in doomed:
        logger.info("keep_last_n_checkpoints: removing %s", path)
        shutil.rmtree(path, ignore_errors=True)
    return doomed
