"""Download one file over HTTP(S): resumable, verified, atomic.

The bytes go to ``<dest>.partial`` and the server's validators (ETag, Last-Modified, total length) to
``<dest>.partial.meta``. A connection that drops keeps both; the download continues, within this call after a
backoff (``retries`` times) and in a later call, with ``Range: bytes=N-`` and ``If-Range: <validator>``. A ``206``
whose ``Content-Range`` starts at N and whose validators match is appended; a ``200`` (the server ignores ranges,
or the file changed) truncates the partial file and starts from byte 0, as does a ``206`` that does not match.
When the server announces no length, the end of the body is confirmed by one more ``Range`` request (``416`` =
nothing more; ``206`` = the connection was cut, the rest is appended). The finished file is checked against its
length, the expected size / SHA-256 when known and its format (``megatron.data.stream_check``), then renamed into
place, so ``dest`` exists only complete and verified. A failed check removes the partial file and raises
``DataError`` (one line naming the URL and the reason).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron.data.stream_check import check_complete
from megatron.errors import DataError
from megatron.logging.progress import progress

logger = logging.getLogger(__name__)

CHUNK = 1 << 20
RETRIES = 5  # transient failures retried within one call
BACKOFF_S = 2.0  # first wait; doubles up to 60 s
META_SUFFIX = ".partial.meta"
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_FATAL_HTTP = range(400, 500)  # client errors other than 408/429 are not retried
_RETRIED_HTTP = (408, 429)


@dataclass(frozen=True)
class RemoteFile:
    """A file to fetch; ``size`` / ``sha256`` are checked when given (GPT-NeoX publishes neither for its corpora)."""

    url: str
    size: int | None = None
    sha256: str | None = None

    @property
    def filename(self) -> str:
        return os.path.basename(urllib.parse.urlparse(self.url).path)


@dataclass(frozen=True)
class _Validators:
    """What the server said about the file the partial bytes came from."""

    url: str
    etag: str | None = None
    last_modified: str | None = None
    total: int | None = None

    def if_range(self) -> str | None:
        if self.etag and not self.etag.startswith("W/"):  # If-Range takes only a strong ETag
            return self.etag
        return self.last_modified

    def same_file(self, other: _Validators) -> bool:
        """False when the server's validators show another version of the file."""
        return all(
            a is None or b is None or a == b
            for a, b in ((self.etag, other.etag), (self.last_modified, other.last_modified), (self.total, other.total))
        )


class _Interrupted(Exception):
    """A transient failure (dropped connection, timeout, 5xx): keep the partial file, retry."""


class _Done(Exception):
    """The server confirmed the partial file is the whole file."""


@dataclass
class _Partial:
    """``<dest>.partial`` and its validators."""

    path: Path
    meta: Path

    def size(self) -> int:
        return self.path.stat().st_size if self.path.is_file() else 0

    def load(self, url: str) -> _Validators | None:
        try:
            v = _Validators(**json.loads(self.meta.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        return v if v.url == url else None

    def save(self, v: _Validators) -> None:
        tmp = self.meta.with_name(self.meta.name + ".tmp")
        tmp.write_text(json.dumps(asdict(v)))
        os.replace(tmp, self.meta)

    def restart(self) -> None:
        self.path.write_bytes(b"")
        self.meta.unlink(missing_ok=True)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self.meta.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _validators(url: str, response: http.client.HTTPResponse, total: int | None) -> _Validators:
    return _Validators(url, response.headers.get("ETag"), response.headers.get("Last-Modified"), total)


def _open(
    remote: RemoteFile, part: _Partial, have: int, known: _Validators | None, timeout: float
) -> http.client.HTTPResponse:
    """The response for the next bytes; raises ``_Done`` when the server says there are none."""
    request = urllib.request.Request(remote.url, headers={"User-Agent": "neox-forge"})
    if have:
        request.add_header("Range", f"bytes={have}-")
        if known is not None and known.if_range():
            request.add_header("If-Range", known.if_range() or "")
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:
            match = re.fullmatch(r"bytes \*/(\d+)", e.headers.get("Content-Range") or "")
            total = int(match.group(1)) if match else (known.total if known else None)
            if total is None or total == have:
                raise _Done from None
            logger.info("%s: the server's file is %s bytes, not %d; starting again", remote.url, total, have)
            part.restart()
            raise _Interrupted(f"HTTP 416, the file has {total} bytes") from None
        if e.code in _FATAL_HTTP and e.code not in _RETRIED_HTTP:
            raise DataError(f"cannot download {remote.url}: HTTP {e.code} {e.reason}") from None
        raise _Interrupted(f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise _Interrupted(str(getattr(e, "reason", e))) from None


def _attempt(remote: RemoteFile, part: _Partial, timeout: float, confirm_end: bool) -> bool:
    """One request; True when the partial file holds the whole file. ``confirm_end``: the last body had no
    announced length, and a server that ignores ``Range`` cannot tell us more (accept what we have)."""
    have = part.size()
    known = part.load(remote.url) if have else None
    try:
        response = _open(remote, part, have, known, timeout)
    except _Done:
        return True
    with response:
        length = response.headers.get("Content-Length")
        if response.status == 206 and have:
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range") or "")
            total = None if match is None or match.group(3) == "*" else int(match.group(3))
            fresh = _validators(remote.url, response, total)
            if match is None or int(match.group(1)) != have or (known is not None and not known.same_file(fresh)):
                logger.info("%s: the server's reply does not continue byte %d; starting again", remote.url, have)
                part.restart()
                raise _Interrupted(f"Content-Range {response.headers.get('Content-Range')!r} does not match")
            if known is not None:  # a 206 may omit validators the first reply gave: keep them for the next resume
                fresh = _Validators(
                    remote.url,
                    fresh.etag or known.etag,
                    fresh.last_modified or known.last_modified,
                    total or known.total,
                )
        else:
            if confirm_end:
                logger.warning("%s: the server neither announces the length nor resumes; trusting its end", remote.url)
                return True
            if have:
                logger.info("%s: the server sent the whole file (no resume, or it changed); starting again", remote.url)
            have, total = 0, (int(length) if length is not None else None)
            fresh = _validators(remote.url, response, total)
        part.save(fresh)
        try:
            with (
                open(part.path, "ab" if have else "wb") as out,
                progress(desc=remote.filename, total=total, initial=have, unit="B", unit_scale=True) as bar,
            ):
                for block in iter(lambda: response.read(CHUNK), b""):
                    out.write(block)
                    bar.update(len(block))
        except (OSError, http.client.HTTPException) as e:  # the connection dropped: keep what arrived
            raise _Interrupted(str(e) or type(e).__name__) from None
    got = part.size()
    if total is None:
        return False  # no length: the next request confirms the end (416) or brings the rest (206)
    if got < total:
        raise _Interrupted(f"the connection closed after {got} of {total} bytes")
    if got > total:
        part.remove()
        raise DataError(f"{remote.url}: received {got} bytes but the server announced {total}; removed, run again")
    return True


def _verify(part: _Partial, remote: RemoteFile, dest: Path) -> None:
    have = part.size()
    if remote.size is not None and have != remote.size:
        part.remove()
        raise DataError(f"{remote.url}: downloaded {have} bytes but expected {remote.size}; removed, run again")
    if remote.sha256 is not None:
        got = _sha256(part.path)
        if got != remote.sha256.lower():
            part.remove()
            raise DataError(f"{remote.url}: SHA-256 mismatch (expected {remote.sha256}, got {got}); removed")
    try:
        check_complete(part.path, dest.name)
    except DataError as e:
        part.remove()
        raise DataError(f"{remote.url}: {e}; removed, run again") from None


def download_file(
    remote: RemoteFile,
    dest: str | Path,
    timeout: float = 60.0,
    retries: int | None = None,
    backoff_s: float | None = None,
) -> Path:
    """Fetch ``remote`` to ``dest`` (see the module docstring); an existing ``dest`` is kept as it is. A transient
    failure is retried ``retries`` times (default ``RETRIES``), after ``backoff_s`` (``BACKOFF_S``), doubling up to
    60 s."""
    retries = RETRIES if retries is None else retries
    backoff_s = BACKOFF_S if backoff_s is None else backoff_s
    dest = Path(dest)
    if dest.is_file():
        return dest
    if urllib.parse.urlparse(remote.url).scheme not in ("http", "https"):
        raise DataError(f"{remote.url}: only http and https URLs are downloaded")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = _Partial(dest.with_name(dest.name + ".partial"), dest.with_name(dest.name + META_SUFFIX))
    failures, confirm_end = 0, False
    while True:
        try:
            if _attempt(remote, part, timeout, confirm_end):
                break
            confirm_end = True
            continue
        except _Interrupted as e:
            reason = str(e)
        confirm_end = False
        failures += 1
        if failures > retries:
            raise DataError(
                f"download of {remote.url} interrupted ({reason}) after {failures} tries; {part.size()} bytes kept "
                f"in {part.path}, run again to resume (offline? copy the file to {dest})"
            )
        delay = min(backoff_s * 2 ** (failures - 1), 60.0)
        logger.warning("%s: %s; retrying in %.1f s (%d of %d)", remote.url, reason, delay, failures, retries)
        time.sleep(delay)
    _verify(part, remote, dest)
    os.replace(part.path, dest)
    part.meta.unlink(missing_ok=True)
    return dest
