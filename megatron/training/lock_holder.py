"""What a ``save`` folder's lock file says about its holder, read strictly, and whether that holder is gone.

A lock file this program wrote is a small UTF-8 JSON object (host, pid, process start time, UTC start time, run
id), written whole to a temporary file and then linked into place, so it is never half-written. Anything else — a
directory, a symbolic link, binary or oversized content, a pid outside 1..4194304, a missing field — was not
written by a run of this program (or was damaged, e.g. zero-filled by a crash of the whole machine): it is reported
as one line naming the file, never guessed at, since whether its owner still runs cannot be told.
"""

from __future__ import annotations

import json
import math
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from megatron.checkpoint import CheckpointError

MAX_LOCK_BYTES = 4096
PID_MAX = 4_194_304  # Linux's largest pid_max (2**22)


@dataclass(frozen=True)
class Holder:
    """The run a lock file names."""

    host: str
    pid: int
    process_start: float
    started: str
    run_id: str

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"

    def is_gone(self) -> bool:
        """True when the holder ran on this host and that process no longer runs (a reused pid counts as gone).
        A holder on another host cannot be checked from here: never gone."""
        if self.host != socket.gethostname():
            return False
        try:
            return abs(psutil.Process(self.pid).create_time() - self.process_start) > 1.0
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:  # e.g. access denied: it may well run
            return False


def read_raw(path: Path) -> bytes | None:
    """The lock file's bytes (None when there is none); CheckpointError when ``path`` is not a small plain file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symbolic link
        raise _malformed(
            path, "a symbolic link" if os.path.islink(path) else f"cannot be opened: {e.strerror}"
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _malformed(path, "a directory" if stat.S_ISDIR(mode) else "not a regular file")
        data = os.read(fd, MAX_LOCK_BYTES + 1)
    except OSError as e:
        raise _malformed(path, f"cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_LOCK_BYTES:
        raise _malformed(path, f"larger than {MAX_LOCK_BYTES} bytes")
    return data


def parse(path: Path, data: bytes) -> Holder:
    """The holder a lock file's bytes name; CheckpointError naming ``path`` for anything this program never writes."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise _malformed(path, "not UTF-8 text") from None
    except ValueError:
        raise _malformed(path, "empty" if not data.strip() else "not JSON") from None
    if not isinstance(obj, dict):
        raise _malformed(path, f"JSON {type(obj).__name__}, not an object")
    host = _text(path, obj, "host", 255)
    pid = obj.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 1 <= pid <= PID_MAX:
        raise _malformed(path, f"pid {_short(pid)} is not a process id (an integer from 1 to {PID_MAX})")
    start = obj.get("process_start")
    if not isinstance(start, int | float) or isinstance(start, bool) or not math.isfinite(start) or start < 0:
        raise _malformed(path, f"process_start {_short(start)} is not a time (a finite number >= 0)")
    return Holder(host, pid, float(start), _text(path, obj, "started", 64), _text(path, obj, "run_id", 64))


def read_holder(path: Path) -> Holder | None:
    """The holder of the lock at ``path`` (None when there is no lock); CheckpointError when it is malformed."""
    data = read_raw(path)
    return None if data is None else parse(path, data)


def _text(path: Path, obj: dict[str, Any], key: str, limit: int) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= limit or not value.isprintable():
        raise _malformed(path, f"{key} {_short(value)} is not a short printable text")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _malformed(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"lock file {path} is not a lock this program wrote ({why}): if no run is using {path.parent}, "
        "delete it and start again"
    )
