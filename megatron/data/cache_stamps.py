"""Small JSON stamp files that say what a cache next to the data was computed from.

A cache (index maps, the token-id range) is trusted only when its stamp equals what it would be computed from now
(the data files' identity, the split's document range, the sample parameters); anything else — no stamp, a stamp of
other inputs, an unreadable stamp — means "rebuild". Stamps are written atomically and after the cache itself, so a
stamp never vouches for a half-written cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

STAMP_VERSION = 1


def read_stamp(path: str) -> dict[str, Any] | None:
    """The stamp at ``path``, or None when it is missing or not a readable JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def write_stamp(path: str, value: dict[str, Any]) -> bool:
    """Write ``value`` to ``path`` atomically; False (logged) when the folder is not writable."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("cannot write the cache stamp %s (%s); the cache will be checked again next run", path, e)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return False
    return True


def remove_stamp(path: str) -> None:
    """Remove ``path`` if present (before rebuilding what it vouched for)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def differences(found: dict[str, Any] | None, expected: dict[str, Any]) -> str:
    """Why ``found`` does not vouch for ``expected``, in a few words ('' when it does)."""
    if found is None:
        return "no stamp (built by another tool or an older version, or interrupted)"
    changed = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
    if not changed:
        return ""
    shown = ", ".join(f"{k} {found.get(k)!r} -> {expected.get(k)!r}" for k in changed[:3])
    return f"built for other inputs ({shown}{', ...' if len(changed) > 3 else ''})"
