"""Is a downloaded file complete? Checked by its format, for a stream whose length nobody vouches for.

* ``.zst``: every zstd frame decodes to its end (a truncated last frame, bad data or trailing bytes are errors) and
  its content checksum, when the frame has one, matches (libzstd checks it while decoding).
* ``.gz`` / ``.tgz`` / ``.tar.gz``: every gzip member ends with its trailer, whose CRC-32 and length (ISIZE) match.
* ``.zip``: the central directory is present (it is the last thing in the file) and every member's CRC-32 matches.
* ``.tar``: every member's data lies inside the file.

A cut exactly between two zstd frames or gzip members leaves a valid shorter file: only a known length, size or
checksum catches that (``megatron.data.download`` confirms the end with the server when no length is announced).
"""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path

from megatron.data.document_reader import open_binary
from megatron.errors import DataError

CHUNK = 1 << 20


def _read_through(path: Path, name: str) -> None:
    kind = "zstd" if name.endswith(".zst") else "gzip"
    try:
        with open_binary(str(path), name) as f:
            while f.read(CHUNK):
                pass
    except (EOFError, OSError, ValueError) as e:
        raise DataError(f"{name}: truncated or corrupt {kind} stream ({e})") from None
    except Exception as e:  # zstandard.ZstdError
        if type(e).__module__.startswith("zstandard"):
            raise DataError(f"{name}: corrupt zstd stream ({e})") from None
        raise


def _check_zip(path: Path, name: str) -> None:
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise DataError(f"{name}: not a complete zip archive ({e})") from None
    if bad is not None:
        raise DataError(f"{name}: member {bad!r} fails its CRC check")


def _check_tar(path: Path, name: str) -> None:
    size = path.stat().st_size
    try:
        with tarfile.open(path, "r:") as t:
            for member in t:
                if member.offset_data + member.size > size:
                    raise DataError(f"{name}: member {member.name!r} is cut off (the archive is truncated)")
    except tarfile.TarError as e:
        raise DataError(f"{name}: not a complete tar archive ({e})") from None


def check_complete(path: Path, name: str) -> None:
    """Raise ``DataError`` (one line) when ``path``, in the format its final ``name`` says, is truncated or corrupt."""
    if path.stat().st_size == 0:
        raise DataError(f"{name}: the file is empty")
    if name.endswith(".zip"):
        _check_zip(path, name)
    elif name.endswith((".zst", ".gz", ".tgz")):
        _read_through(path, name)
    elif name.endswith(".tar"):
        _check_tar(path, name)
