"""The one owner of GPT-NeoX's checkpoint tag: ``global_step<N>``, the folder of the checkpoint after N steps.

Formatting (:func:`checkpoint_tag`), parsing (:func:`tag_iteration`) and listing (:func:`checkpoint_dirs`) live
here, so training, the checkpoint readers and writers and ``tools/ckpts`` agree on the name (standard library only).
"""

from __future__ import annotations

import re
from pathlib import Path

TAG_PREFIX = "global_step"
TAG_RE = re.compile(rf"^{TAG_PREFIX}(\d+)$")


def checkpoint_tag(iteration: int) -> str:
    """GPT-NeoX's tag of the checkpoint saved after ``iteration`` steps (``global_step<iteration>``)."""
    if iteration < 0:
        raise ValueError(f"a checkpoint iteration is >= 0, got {iteration}")
    return f"{TAG_PREFIX}{int(iteration)}"


def tag_iteration(tag: str | Path) -> int | None:
    """N of a ``global_stepN`` tag or folder (a path's last component), None for any other name."""
    match = TAG_RE.match(Path(tag).name if isinstance(tag, Path) else tag)
    return int(match.group(1)) if match else None


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """The ``global_stepN`` folders of ``root``, oldest first by N (none when ``root`` is not a folder)."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [(n, p) for p in base.iterdir() if p.is_dir() and (n := tag_iteration(p.name)) is not None]
    return [p for _, p in sorted(found, key=lambda np: np[0])]
