"""Uploading committed checkpoints to S3 (``s3_path``, ``s3_chunk_size``), in the background on rank 0.

```
s3://bucket/prefix/<basename of save>/global_step<N>/<every file of the checkpoint>   GPT-NeoX's layout
                                     /global_step<N>/manifest.json                   after the other files
s3://bucket/prefix/<basename of save>/latest                                         "global_step<N>", last
```

After a save's local commit, rank 0 hands the tag to :class:`S3Uploader`, whose thread uploads the files the
checkpoint's manifest lists, then the manifest, then ``latest``: a reader of ``latest`` (``load: s3://...``) only
sees a checkpoint whose every file is there. A file larger than ``s3_chunk_size`` goes up as a multipart upload in
parts of that size, smaller ones in one request; every request carries its Content-MD5, every part's ETag and the
object's size and ETag (``md5(part MD5s)-N``) are compared with what was read from the local file, and a mismatch is
retried like a network error (``s3_client.Attempts``). A checkpoint whose upload fails is logged in one line and
skipped; nothing local is written or removed. Retention (``keep_last_n_checkpoints``) keeps a checkpoint until its
upload has ended (:meth:`S3Uploader.pending`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron import mpu
from megatron.checkpoint.manifest import MANIFEST, read_manifest
from megatron.checkpoint.run_config import CheckpointConfig
from megatron.checkpoint.s3_client import (
    Attempts,
    ChecksumMismatch,
    RetryPolicy,
    S3Error,
    composite_etag,
    endpoint_of,
    make_client,
    md5_b64,
)
from megatron.neox_arguments.s3_checks import S3Url, parse_s3_url

logger = logging.getLogger(__name__)

LATEST = "latest"


def remote_root(s3_path: str, save: str) -> S3Url:
    """Where the checkpoints of ``save`` go: ``<s3_path>/<basename of save>`` (GPT-NeoX's layout)."""
    return parse_s3_url(s3_path).child(os.path.basename(os.path.abspath(save)))


def retry_policy(cfg: CheckpointConfig) -> RetryPolicy:
    """The retry policy of the S3 keys."""
    return RetryPolicy(attempts=cfg.s3_upload_attempts, timeout=cfg.s3_timeout)


def _check_etag(got: Any, expected: str) -> None:
    etag = str(got).strip('"')
    if etag != expected:
        raise ChecksumMismatch(f"the server's ETag {etag} is not the MD5 {expected} of the bytes sent")


def _read(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise S3Error(f"{path}: read {len(data)} bytes at offset {offset}, expected {size} (the file changed)")
    return data


def _put(client: Any, path: Path, dest: S3Url, size: int, attempts: Attempts) -> str:
    """One request (a file up to the chunk size); returns the object's expected ETag."""
    data = _read(path, 0, size)
    digest = hashlib.md5(data).digest()

    def request() -> None:
        reply = client.put_object(Bucket=dest.bucket, Key=dest.prefix, Body=data, ContentMD5=md5_b64(digest))
        _check_etag(reply.get("ETag"), digest.hex())

    attempts.run(f"upload of {dest}", request)
    return digest.hex()


def _multipart(client: Any, path: Path, dest: S3Url, size: int, chunk: int, attempts: Attempts) -> str:
    """A multipart upload in parts of ``chunk`` bytes, each part's ETag checked; returns the object's ETag."""
    bucket, key = dest.bucket, dest.prefix
    create = attempts.run(
        f"start of the upload of {dest}", lambda: client.create_multipart_upload(Bucket=bucket, Key=key)
    )
    upload_id = create["UploadId"]
    try:
        parts, digests = [], []
        for number, offset in enumerate(range(0, size, chunk), start=1):
            data = _read(path, offset, min(chunk, size - offset))
            digest = hashlib.md5(data).digest()

            def request(data: bytes = data, digest: bytes = digest, number: int = number) -> Any:
                reply = client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data, ContentMD5=md5_b64(digest)
                )
                _check_etag(reply.get("ETag"), digest.hex())
                return reply["ETag"]

            parts.append({"ETag": attempts.run(f"part {number} of {dest}", request), "PartNumber": number})
            digests.append(digest)
        attempts.run(
            f"completion of {dest}",
            lambda: client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            ),
        )
    except BaseException:
        try:  # parts of a failed upload would stay stored (and billed)
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as e:
            logger.debug("S3: aborting the upload of %s failed: %s", dest, e)
        raise
    return composite_etag(digests)


def upload_file(client: Any, path: Path, dest: S3Url, chunk: int, attempts: Attempts) -> int:
    """Upload ``path`` to ``dest`` and check the stored object's size and ETag; the whole file is sent again when
    they differ (while attempts are left). Returns its size."""
    while True:
        size = path.stat().st_size
        if size <= chunk:
            expected = _put(client, path, dest, size, attempts)
        else:
            expected = _multipart(client, path, dest, size, chunk, attempts)
        try:
            head = client.head_object(Bucket=dest.bucket, Key=dest.prefix)
            if int(head["ContentLength"]) != size:
                raise ChecksumMismatch(f"the server holds {head['ContentLength']} bytes, the file {size}")
            _check_etag(head.get("ETag"), expected)
            return size
        except Exception as e:
            attempts.failed(f"check of {dest}", e)  # raises S3Error when no attempt is left, else uploads again


@dataclass
class UploadReport:
    """What the upload of one checkpoint did."""

    tag: str
    destination: str
    ok: bool
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retries: list[str] = field(default_factory=list)
    error: str = ""


def upload_checkpoint(
    client: Any, save: str, tag: str, root: S3Url, chunk: int, policy: RetryPolicy, attempts_factory: Any = None
) -> UploadReport:
    """Upload the committed checkpoint ``save/tag`` (its manifest's files, the manifest, then ``latest``)."""
    start = time.perf_counter()
    directory = Path(save) / tag
    dest = root.child(tag)
    report = UploadReport(tag, str(dest), ok=False)
    make_attempts = attempts_factory or (lambda: Attempts(policy))
    try:
        try:
            manifest = read_manifest(directory)
        except ValueError as e:
            raise S3Error(str(e)) from None
        if manifest is None or not isinstance(manifest.get("files"), dict):
            raise S3Error(f"{directory} has no manifest listing its files (not a committed checkpoint)")
        for name in [*sorted(manifest["files"]), MANIFEST]:
            path = directory / name
            if not path.is_file():
                raise S3Error(f"{path} is missing (removed before its upload)")
            attempts = make_attempts()
            try:
                report.bytes += upload_file(client, path, dest.child(name), chunk, attempts)
            finally:
                report.retries += attempts.retries
            report.files += 1
        attempts = make_attempts()
        latest = root.child(LATEST)
        body = tag.encode()
        digest = hashlib.md5(body).digest()

        def put_latest() -> None:
            reply = client.put_object(Bucket=latest.bucket, Key=latest.prefix, Body=body, ContentMD5=md5_b64(digest))
            _check_etag(reply.get("ETag"), digest.hex())

        attempts.run(f"upload of {latest}", put_latest)
        report.retries += attempts.retries
        report.ok = True
    except S3Error as e:
        report.error = str(e)
    except OSError as e:  # reading a local file
        report.error = f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
    report.seconds = time.perf_counter() - start
    return report


class S3Uploader:
    """Rank 0's background uploads of committed checkpoints, one at a time in the order they were committed.

    :meth:`submit` returns at once; :meth:`close` waits (bounded) for what is pending. The client is made when the
    uploader is, so a missing boto3 or missing credentials are reported before training starts.
    """

    def __init__(self, s3_path: str, save: str, chunk: int, policy: RetryPolicy, flush_timeout: float) -> None:
        self.root = remote_root(s3_path, save)
        self.save, self.chunk, self.policy, self.flush_timeout = save, chunk, policy, flush_timeout
        self.client = make_client(policy)
        self.reports: list[UploadReport] = []
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="s3-checkpoint-upload", daemon=True)
        self._thread.start()
        logger.info("uploading checkpoints of %s to %s (endpoint %s)", save, self.root, endpoint_of(self.client))

    @classmethod
    def from_config(cls, cfg: CheckpointConfig) -> S3Uploader:
        """The uploader of ``cfg``'s ``save`` and S3 keys (``s3_path`` must be set)."""
        assert cfg.s3_path is not None and cfg.save is not None
        return cls(cfg.s3_path, cfg.save, cfg.s3_chunk_size, retry_policy(cfg), cfg.s3_flush_timeout)

    def submit(self, tag: str) -> None:
        """Queue the upload of the committed checkpoint ``tag`` (returns at once)."""
        with self._lock:
            self._pending.append(tag)
        self._queue.put(tag)

    def pending(self) -> list[str]:
        """Tags whose upload has not ended (queued or running)."""
        with self._lock:
            return list(self._pending)

    def _work(self) -> None:
        while (tag := self._queue.get()) is not None:
            try:
                report = upload_checkpoint(self.client, self.save, tag, self.root, self.chunk, self.policy)
            except Exception as e:  # a bug must not end the thread silently: the run's log says what happened
                report = UploadReport(tag, str(self.root.child(tag)), ok=False, error=f"{type(e).__name__}: {e}")
            self._log(report)
            with self._lock:
                self.reports.append(report)
                self._pending.remove(tag)

    def _log(self, report: UploadReport) -> None:
        local = Path(self.save) / report.tag
        if report.ok:
            retried = f"; {len(report.retries)} retried: {report.retries[-1]}" if report.retries else ""
            logger.info(
                "uploaded checkpoint %s to %s (%d files, %d bytes in %.1f s%s)",
                local, report.destination, report.files, report.bytes, report.seconds, retried,
            )  # fmt: skip
        else:
            logger.error(
                "S3 upload of checkpoint %s to %s failed after %.1f s, training continues (the local checkpoint is "
                "intact): %s",
                local, report.destination, report.seconds, report.error,
            )  # fmt: skip

    def close(self, timeout: float | None = None) -> list[str]:
        """Wait up to ``timeout`` seconds (default ``s3_flush_timeout``) for the pending uploads; returns the tags
        still not uploaded (a thread still running is left behind: it dies with the process)."""
        timeout = self.flush_timeout if timeout is None else timeout
        waiting = self.pending()
        if waiting:
            logger.info("waiting up to %g s (s3_flush_timeout) for the S3 upload of %s", timeout, ", ".join(waiting))
        start = time.perf_counter()
        self._queue.put(None)
        self._thread.join(timeout)
        left = self.pending()
        if left:
            logger.error(
                "S3: gave up waiting after %g s (s3_flush_timeout); not uploaded: %s (the local checkpoints are "
                "intact)",
                timeout, ", ".join(left),
            )  # fmt: skip
        elif waiting:
            logger.info("S3 uploads finished after %.1f s", time.perf_counter() - start)
        return left


def start_uploads(cfg: CheckpointConfig) -> S3Uploader | None:
    """All ranks call: rank 0 starts the uploader when ``s3_path`` is set (None elsewhere); a missing boto3 or
    missing credentials are the same one-line S3Error on every rank, before anything is trained."""
    if cfg.s3_path is None or not cfg.save:
        return None
    uploader, error = None, ""
    if mpu.world_rank() == 0:
        try:
            uploader = S3Uploader.from_config(cfg)
        except S3Error as e:
            error = str(e)
    error = mpu.broadcast_object(error)
    if error:
        raise S3Error(error)
    return uploader
