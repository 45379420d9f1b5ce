"""One run per ``save`` folder: a lock file that global rank 0 holds for the whole run.

``<save>/.neox-run.lock`` holds JSON with the holder's host, pid, process start time, UTC start time and run id.
It is created atomically (written to a temp file, then ``os.link``, which fails if the lock exists, also on NFS), so
two runs never both get it. A second run on the same folder is refused before it writes anything, naming the
holder. A lock whose holder is gone (same host, pid not running or reused by another process) is taken over with a
warning: under a takeover guard (megatron/training/lock_takeover.py) the process checks that the stale lock is still
there and replaces it atomically, so of several processes taking over at once exactly one gets it. One held from
another host cannot be checked from here and is refused with its path, to delete by hand once that run is known to
be gone; a lock file this program never writes (megatron/training/lock_holder.py) is refused the same way. The run id (random per run) also names the run's temporary checkpoint folders,
so a save's cleanup only ever removes its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from megatron import mpu
from megatron.checkpoint import CheckpointError
from megatron.training.lock_holder import parse, read_holder, read_raw
from megatron.training.lock_takeover import takeover_guard

logger = logging.getLogger(__name__)

LOCK_NAME = ".neox-run.lock"


@dataclass
class SaveLock:
    """The lock this run holds (rank 0 only; other ranks get ``path`` None and the same ``run_id``)."""

    path: Path | None
    run_id: str
    created_folder: bool = False  # the lock created ``save``: removed again on release if still empty

    def release(self) -> None:
        """Remove the lock file if it is still ours (and the save folder if the lock created it and it is empty)."""
        if self.path is None:
            return
        try:
            holder = read_holder(self.path)
        except CheckpointError:  # replaced by something else: not ours to remove
            holder = None
        if holder is not None and holder.run_id == self.run_id:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            if self.created_folder:
                with contextlib.suppress(OSError):  # not empty: the run saved something
                    self.path.parent.rmdir()
        self.path = None


def acquire(save: str) -> SaveLock:
    """Take ``save``'s lock for this process; CheckpointError naming the holder when another run has it, or naming
    the lock file when it is not a lock this program wrote."""
    folder = Path(save)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    run_id = secrets.token_hex(4)
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": psutil.Process().create_time(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "run_id": run_id,
    }
    tmp = folder / f".neox-run.lock.{me['host']}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(me) + "\n", encoding="utf-8")
    try:
        for _ in range(5):
            try:
                os.link(tmp, path)
                return SaveLock(path, run_id, created)
            except FileExistsError:
                pass
            seen = read_raw(path)
            if seen is None:
                continue  # released just now
            holder = parse(path, seen)
            if not holder.is_gone():
                raise CheckpointError(
                    f"save folder {save} is in use by another run ({holder.describe()}; lock file {path}): "
                    "wait for it to end or use another save folder; delete the lock file only if that run is gone"
                )
            with takeover_guard(path):  # one process at a time checks the stale lock is still there and replaces it
                if read_raw(path) != seen:
                    continue  # taken over or released meanwhile: look again
                logger.warning("taking over the lock of a run that is gone (%s): %s", holder.describe(), path)
                os.replace(tmp, path)  # atomic: the lock file exists throughout, so no other run can link it in
                return SaveLock(path, run_id, created)
        raise CheckpointError(f"save folder {save}: could not take the lock {path} (other runs keep taking it)")
    finally:
        tmp.unlink(missing_ok=True)


def acquire_on_rank0(save: str) -> SaveLock:
    """All ranks call: rank 0 takes the lock; every rank gets the run id, or the same CheckpointError."""
    lock, error = None, ""
    if mpu.world_rank() == 0:
        try:
            lock = acquire(save)
        except (CheckpointError, OSError) as e:
            error = str(e) if isinstance(e, CheckpointError) else f"save folder {save}: cannot create the lock: {e}"
    outcome = mpu.broadcast_object({"error": error, "run_id": lock.run_id if lock else ""})
    if outcome["error"]:
        raise CheckpointError(outcome["error"])
    return lock or SaveLock(None, outcome["run_id"])
