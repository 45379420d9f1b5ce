"""Unpack a downloaded archive (``.zip``, ``.tar``, ``.tar.gz``/``.tgz``): every member checked first, then all or
nothing.

Before anything is written, every member is checked: a relative path without ``..``, a regular file or folder
(no symlinks, hard links or devices), a total size that fits the free disk space (and ``MAX_TOTAL_BYTES``) and, for
compressed members, at most ``MAX_RATIO`` times their compressed size (zip bombs). The archive is then extracted
into a temporary folder next to the target, and its entries are renamed into the target only once all of it
extracted; a refused or failed archive leaves nothing behind, so running again checks it again and fails the same.
A zip member without a document suffix (enwik8) is written as ``<name>.txt``.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from megatron.errors import DataError

MAX_RATIO = 250  # uncompressed / compressed; text compresses ~3-10x, deflate bombs ~1000x
MAX_TOTAL_BYTES = 1 << 42  # 4 TiB
_SMALL = 1 << 20  # tiny members may compress better than MAX_RATIO
DOC_SUFFIXES = (".jsonl", ".json", ".txt", ".zst", ".gz")
ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")
UNPACKING_SUFFIX = ".unpacking"  # the temporary folder


@dataclass(frozen=True)
class _Member:
    name: str  # as written in the archive
    target: PurePosixPath  # relative path it is written to
    size: int
    compressed: int | None  # None: not separately compressed (tar)


def _safe_path(archive: Path, name: str) -> PurePosixPath:
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]) or not path.parts:
        raise DataError(f"{archive}: member {name!r} points outside the folder; nothing unpacked")
    return path


def _zip_members(archive: Path) -> list[_Member]:
    members = []
    with zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            kind = stat.S_IFMT(info.external_attr >> 16)  # 0 when the archiver recorded no Unix file type
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise DataError(f"{archive}: member {info.filename!r} is a link or device; nothing unpacked")
            path = _safe_path(archive, info.filename)
            if info.is_dir():
                continue
            target = path if path.name.endswith(DOC_SUFFIXES) else path.with_name(path.name + ".txt")
            members.append(_Member(info.filename, target, info.file_size, info.compress_size))
    return members


def _tar_members(archive: Path) -> list[_Member]:
    members = []
    with tarfile.open(archive) as t:
        for info in t:
            if not (info.isreg() or info.isdir()):
                raise DataError(f"{archive}: member {info.name!r} is a link or device; nothing unpacked")
            path = _safe_path(archive, info.name)
            if info.isreg():
                members.append(_Member(info.name, path, info.size, None))
    return members


def check_members(archive: Path, folder: Path) -> list[_Member]:
    """Every member of ``archive`` checked (see the module docstring); raises ``DataError`` naming the first bad one."""
    members = _zip_members(archive) if archive.name.endswith(".zip") else _tar_members(archive)
    for m in members:
        if m.compressed is not None and m.size > _SMALL and m.size > MAX_RATIO * max(m.compressed, 1):
            raise DataError(
                f"{archive}: member {m.name!r} expands {m.size // max(m.compressed, 1)}x (limit {MAX_RATIO}x; a zip "
                "bomb?); nothing unpacked"
            )
    total = sum(m.size for m in members)
    if archive.name.endswith((".tar.gz", ".tgz")) and total > _SMALL and total > MAX_RATIO * archive.stat().st_size:
        raise DataError(f"{archive}: expands more than {MAX_RATIO}x (a bomb?); nothing unpacked")
    free = shutil.disk_usage(folder).free
    if total > min(free, MAX_TOTAL_BYTES):
        raise DataError(
            f"{archive}: unpacks to {total} bytes but {folder} has {free} free (limit {MAX_TOTAL_BYTES}); "
            "nothing unpacked"
        )
    return members


def _extract(archive: Path, members: list[_Member], tmp: Path) -> None:
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            for m in members:
                target = tmp / m.target
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(m.name) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)  # zipfile checks each member's CRC at its end
    else:
        with tarfile.open(archive) as t:
            t.extractall(tmp, filter="data")


def _replace(src: Path, dest: Path) -> None:
    if dest.is_dir() and not dest.is_symlink():
        shutil.rmtree(dest)
    os.replace(src, dest)


def unpack(archive: Path, folder: Path) -> list[Path]:
    """Check every member, extract into a temporary folder, then rename its entries into ``folder``."""
    tmp = folder / f".{archive.name}{UNPACKING_SUFFIX}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        members = check_members(archive, folder)
        tmp.mkdir()
        _extract(archive, members, tmp)
        entries = sorted(tmp.iterdir())
        for entry in entries:
            _replace(entry, folder / entry.name)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"{archive}: cannot unpack ({type(e).__name__}: {e}); nothing unpacked") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [folder / m.target for m in members]
