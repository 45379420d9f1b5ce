"""Mutual exclusion among processes taking over the same stale ``save`` folder lock.

Taking over is "check the lock is still the stale one, then replace it"; without exclusion two processes that both
read the stale lock could each replace it, and both believe they hold it. The guard is ``<lock>.takeover``:

* where the filesystem has ``flock`` (local filesystems; NFS emulates it with server-side locks), the guard is
  an ``flock`` on that file, which the kernel drops when its holder dies: a crashed takeover leaves at most an
  unlocked file that the next takeover reuses and removes. The file is removed while still locked, and a process
  that locked a file that is no longer the one at that path (removed meanwhile) tries again.
* where ``flock`` fails (``ENOLCK``, ``EOPNOTSUPP``: NFS without a lock daemon, some FUSE filesystems), whoever
  creates the file (``O_CREAT|O_EXCL``, atomic on local filesystems and NFSv3+) holds the guard; the others wait
  for it to go. A process killed inside the few milliseconds of a takeover leaves the file behind; the next
  takeover then stops after :data:`WAIT_S` with one line naming it, to delete by hand (removing it automatically
  would let two processes in at once).

Only locks held on this host are ever taken over (a lock of another host cannot be checked), so every process
that takes over a given lock runs on the same host: even an ``flock`` that is local to one host excludes them all.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron.checkpoint import CheckpointError

GUARD_SUFFIX = ".takeover"
WAIT_S = 10.0  # a takeover takes milliseconds; waiting longer than this means its holder hangs or died
_POLL_S = 0.002
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EBADF, errno.EINVAL}


@contextlib.contextmanager
def takeover_guard(lock: Path) -> Iterator[None]:
    """Hold the takeover guard of ``lock`` for the ``with`` body; CheckpointError when it stays taken."""
    release = _take(lock.with_name(lock.name + GUARD_SUFFIX), lock, time.monotonic() + WAIT_S)
    try:
        yield
    finally:
        release()


def _take(guard: Path, lock: Path, deadline: float) -> Callable[[], None]:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        try:
            fd, created = os.open(guard, flags | os.O_CREAT | os.O_EXCL, 0o600), True
        except FileExistsError:
            try:
                fd, created = os.open(guard, flags), False
            except FileNotFoundError:
                continue  # removed just now: create it
            except OSError as e:
                raise _stuck(guard, lock, f"cannot be opened: {e.strerror}") from None
        try:
            locked = _flock(fd, guard, lock, deadline)
        except BaseException:
            os.close(fd)
            raise
        if locked:
            if _is_current(fd, guard):
                return lambda: _unlock_and_remove(fd, guard)
            os.close(fd)  # removed (and perhaps re-created) by the holder we waited for: start over
            continue
        os.close(fd)  # no flock on this filesystem: creating the file is the guard
        if created:
            return lambda: guard.unlink(missing_ok=True)
        while guard.exists():
            if time.monotonic() > deadline:
                raise _stuck(guard, lock, f"still there after {WAIT_S:g} s")
            time.sleep(_POLL_S)


def _flock(fd: int, guard: Path, lock: Path, deadline: float) -> bool:
    """True once ``fd`` holds an exclusive flock; False when the filesystem has no flock."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise _stuck(guard, lock, f"locked by another process for over {WAIT_S:g} s") from None
            time.sleep(_POLL_S)
        except OSError as e:
            if e.errno in _NO_FLOCK:
                return False
            raise


def _is_current(fd: int, guard: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(guard, follow_symlinks=False))
    except FileNotFoundError:
        return False


def _unlock_and_remove(fd: int, guard: Path) -> None:
    try:
        guard.unlink(missing_ok=True)  # while still locked: whoever waits on this file sees it is gone
    finally:
        os.close(fd)


def _stuck(guard: Path, lock: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"cannot take over the stale lock {lock}: its takeover guard {guard} is {why} (another process is taking "
        f"the lock over, or one was killed while doing so): if no run is starting in {lock.parent}, delete {guard}"
    )
