"""``manifest.json``: the commit record of a checkpoint, written last.

```
{"format": 2, "tag": "global_step8", "iteration": 8, ...,      # iteration, consumed samples, layout, config
 "files": {"mp_rank_00_model_states.pt": {"size": 123, "sha256": "..."}, ...}}
```

A checkpoint is complete when its manifest exists and every file it lists has the recorded size (the sha256 is
checked on request: ``verify_checkpoint(..., checksums=True)`` / ``inspect_checkpoints.py --verify``). Older
manifests list the files only (existence is checked); GPT-NeoX checkpoints have none (nothing to check).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 2


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` so that readers see the old or the new content, never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # per process: two writers never share a temp file
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_files(directory: Path) -> list[Path]:
    """Every file of a checkpoint folder except the manifest (sorted)."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, **meta: Any) -> dict[str, Any]:
    """fsync every file, then write the manifest (sizes and sha256 of every file) atomically; returns it."""
    files = {}
    for path in checkpoint_files(directory):
        fsync_path(path)
        files[str(path.relative_to(directory))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    for sub in {p.parent for p in directory.rglob("*") if p.is_file()}:
        fsync_path(sub)
    manifest = {"format": FORMAT, **meta, "files": files}
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str))
    return manifest


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of ``directory``, None when it has none; a ValueError naming it when it is unreadable."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or "files" not in manifest:
            raise ValueError("no 'files' entry")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a valid checkpoint manifest ({e})") from None
    return manifest


def verify_checkpoint(directory: Path, *, checksums: bool = False) -> str | None:
    """The first problem of ``directory`` against its manifest (naming the file), None when it is complete."""
    try:
        manifest = read_manifest(directory)
    except ValueError as e:
        return str(e)
    if manifest is None:
        return None
    files = manifest["files"]
    entries = files.items() if isinstance(files, dict) else ((name, None) for name in files)
    for name, entry in entries:
        if name == MANIFEST:
            continue
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if isinstance(entry, dict):
            size = path.stat().st_size
            if size != entry.get("size"):
                return f"{path} has {size} bytes, the manifest records {entry.get('size')} (truncated or replaced)"
            if checksums and entry.get("sha256") and _sha256(path) != entry["sha256"]:
                return f"{path} does not match its sha256 in the manifest (corrupted)"
    return None
