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
import re
from pathlib import Path, PurePosixPath
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


MAX_FILE_SIZE = 2**63 - 1  # the largest size a file can have (off_t)
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def _short(value: Any) -> str:
    """``repr`` cut to 60 characters: a hostile manifest's values stay one readable line."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _check_name(name: Any) -> str | None:
    """What is wrong with a file name listed in a manifest (None: a relative path inside the checkpoint folder)."""
    if not isinstance(name, str) or not name:
        return f"file name {_short(name)} is not a non-empty string"
    parts = PurePosixPath(name).parts
    if "\\" in name or "\0" in name or name.startswith("/") or ".." in parts:
        return f"file name {_short(name)} is not a relative path inside the checkpoint folder"
    return None


def _check_entry(name: str, entry: Any) -> str | None:
    """What is wrong with the ``{"size": N, "sha256": "…"}`` entry of ``name`` (None: nothing)."""
    if not isinstance(entry, dict):
        return f"the entry of {_short(name)} is {type(entry).__name__}, expected an object with size and sha256"
    size = entry.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_FILE_SIZE:
        return f"the size of {_short(name)} is {_short(size)}, expected a byte count from 0 to {MAX_FILE_SIZE}"
    sha = entry.get("sha256")
    if sha is not None and not (isinstance(sha, str) and SHA256_RE.match(sha)):
        return f"the sha256 of {_short(name)} is {_short(sha)}, expected 64 lower-case hex digits"
    return None


def manifest_structure_problem(manifest: Any) -> str | None:
    """What is wrong with a decoded manifest's structure (None: a dict whose ``files`` is a list of names or an
    object of name → ``{size, sha256}``, every name a relative path inside the folder)."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {type(manifest).__name__}, expected an object"
    if "files" not in manifest:
        return "no 'files' entry"
    files = manifest["files"]
    if not isinstance(files, (dict, list)):
        return f"'files' is a JSON {type(files).__name__}, expected an object of file name -> {{size, sha256}}"
    for name in files:
        problem = _check_name(name) or (_check_entry(name, files[name]) if isinstance(files, dict) else None)
        if problem:
            return problem
    return None


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of ``directory``, None when it has none; a ValueError naming it when it is unreadable or its
    structure is not a manifest's (see :func:`manifest_structure_problem`)."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path} is not a valid checkpoint manifest ({type(e).__name__}: {e})") from None
    problem = manifest_structure_problem(manifest)
    if problem:
        raise ValueError(f"{path} is not a valid checkpoint manifest: {problem}")
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
        try:
            problem = _file_problem(directory, name, entry, checksums)
        except OSError as e:  # unreadable, a name too long for the filesystem …
            problem = f"{directory / name} cannot be read ({type(e).__name__}: {e})"
        if problem:
            return problem
    return None


def _file_problem(directory: Path, name: str, entry: dict[str, Any] | None, checksums: bool) -> str | None:
    path = directory / name
    if directory.resolve() not in path.resolve().parents:  # a symlink inside the folder that leads out of it
        return f"{directory / MANIFEST} lists {_short(name)}, which resolves outside {directory}"
    if not path.is_file():
        return f"{path} is missing"
    if isinstance(entry, dict):
        size = path.stat().st_size
        if size != entry.get("size"):
            return f"{path} has {size} bytes, the manifest records {entry.get('size')} (truncated or replaced)"
        if checksums and entry.get("sha256") and _sha256(path) != entry["sha256"]:
            return f"{path} does not match its sha256 in the manifest (corrupted)"
    return None
