"""Download one file over HTTP(S): resumable, verified, atomic.

The bytes go to ``<dest>.partial``; an interrupted download keeps it, and the next call asks the server for the rest
(``Range: bytes=N-``; a server that answers with the whole file restarts it). The finished file is checked against
the server's announced length and the expected size / SHA-256 when known, then renamed into place, so ``dest``
exists only complete and verified. A mismatch removes the partial file and raises ``DataError``; so does a
network failure (one line naming the URL and the reason, the partial file kept for the next try).
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from megatron.errors import DataError
from megatron.logging.progress import progress

logger = logging.getLogger(__name__)

CHUNK = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    """A file to fetch; ``size`` / ``sha256`` are checked when given (GPT-NeoX publishes neither for its corpora)."""

    url: str
    size: int | None = None
    sha256: str | None = None

    @property
    def filename(self) -> str:
        return os.path.basename(urllib.parse.urlparse(self.url).path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _verify(partial: Path, remote: RemoteFile, announced: int | None) -> None:
    have = partial.stat().st_size
    for what, want in (("the server announced", announced), ("expected", remote.size)):
        if want is not None and have != want:
            partial.unlink()
            raise DataError(f"{remote.url}: downloaded {have} bytes but {what} {want}; removed, run again")
    if remote.sha256 is not None:
        got = _sha256(partial)
        if got != remote.sha256.lower():
            partial.unlink()
            raise DataError(f"{remote.url}: SHA-256 mismatch (expected {remote.sha256}, got {got}); removed")


def download_file(remote: RemoteFile, dest: str | Path, timeout: float = 60.0) -> Path:
    """Fetch ``remote`` to ``dest`` (see the module docstring); an existing ``dest`` is kept as it is."""
    dest = Path(dest)
    if dest.is_file():
        return dest
    if urllib.parse.urlparse(remote.url).scheme not in ("http", "https"):
        raise DataError(f"{remote.url}: only http and https URLs are downloaded")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    start = partial.stat().st_size if partial.is_file() else 0
    request = urllib.request.Request(remote.url, headers={"User-Agent": "neox-forge"})
    if start:
        request.add_header("Range", f"bytes={start}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and start and remote.size == start:  # already complete, only the rename was missing
            _verify(partial, remote, None)
            os.replace(partial, dest)
            return dest
        raise DataError(f"cannot download {remote.url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise DataError(f"cannot download {remote.url}: {reason} (offline? copy the file to {dest})") from None
    with response:
        resumed = start > 0 and response.status == 206
        if start and not resumed:
            logger.info("%s: the server does not resume downloads; starting again", remote.url)
            start = 0
        length = response.headers.get("Content-Length")
        announced = start + int(length) if length is not None else None
        try:
            with (
                open(partial, "ab" if resumed else "wb") as out,
                progress(desc=remote.filename, total=announced, initial=start, unit="B", unit_scale=True) as bar,
            ):
                for block in iter(lambda: response.read(CHUNK), b""):
                    out.write(block)
                    bar.update(len(block))
        except (OSError, http.client.HTTPException) as e:  # the connection dropped: keep what arrived, resume later
            raise DataError(f"download of {remote.url} interrupted ({e}); run again to resume") from None
    _verify(partial, remote, announced)
    os.replace(partial, dest)
    return dest
