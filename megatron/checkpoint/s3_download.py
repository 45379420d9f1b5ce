"""``load: s3://bucket/prefix``: download a committed checkpoint into a local cache, then load it from there.

``prefix`` is a folder :mod:`megatron.checkpoint.s3_upload` writes (``<s3_path>/<basename of save>``): its ``latest``
object names the newest checkpoint whose every file was uploaded. The checkpoint ``latest`` names (or
``global_step<iteration>`` when ``iteration`` is set) is downloaded into
``<s3_cache_dir>/<bucket>/<prefix>/global_step<N>``: its ``manifest.json`` first, then each file it lists, whose
size and sha256 must equal the manifest's (a mismatch is retried, then one error line). The files are written into a
``.partial-*`` folder renamed into place when complete, and ``latest`` is written beside it; a checkpoint already
in the cache whose files match the manifest is not downloaded again. On each node the first local rank downloads
(the cache may be node-local), and every rank loads from the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from megatron import mpu
from megatron.checkpoint.manifest import MANIFEST, atomic_write_text, manifest_structure_problem, verify_checkpoint
from megatron.checkpoint.run_config import CheckpointConfig
from megatron.checkpoint.s3_client import Attempts, ChecksumMismatch, RetryPolicy, S3Error, error_code, make_client
from megatron.checkpoint.s3_upload import LATEST, retry_policy
from megatron.checkpoint.tags import checkpoint_dirs, checkpoint_tag, tag_iteration
from megatron.neox_arguments.s3_checks import S3Url, is_s3_url, parse_s3_url

logger = logging.getLogger(__name__)

BLOCK = 1 << 22
MAX_SMALL_OBJECT = 1 << 26  # latest and manifest.json are read into memory: a larger one is not ours


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/neox-forge/s3`` (``~/.cache/neox-forge/s3``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "neox-forge" / "s3"


def cache_root(source: S3Url, cache_dir: str | None) -> Path:
    """The local folder of ``source``'s checkpoints: ``<cache_dir>/<bucket>/<prefix>``."""
    return Path(cache_dir or default_cache_dir(), source.bucket, *[p for p in source.prefix.split("/") if p])


def _get_small(client: Any, where: S3Url, attempts: Attempts, missing: str) -> bytes:
    """The bytes of a small object; S3Error ``missing`` when it does not exist."""

    def request() -> bytes:
        try:
            reply = client.get_object(Bucket=where.bucket, Key=where.prefix)
        except Exception as e:
            if error_code(e) in ("NoSuchKey", "404"):
                raise S3Error(missing) from None
            raise
        if int(reply.get("ContentLength") or 0) > MAX_SMALL_OBJECT:
            raise S3Error(f"{where} holds {reply['ContentLength']} bytes: not a checkpoint's {where.prefix}")
        return bytes(reply["Body"].read())

    return attempts.run(f"download of {where}", request)


def _download(client: Any, where: S3Url, target: Path, size: int, sha256: str, attempts: Attempts) -> None:
    """Download ``where`` into ``target``, checking its size and sha256 (retried on a mismatch)."""

    def request() -> None:
        digest, got = hashlib.sha256(), 0
        reply = client.get_object(Bucket=where.bucket, Key=where.prefix)
        with open(target, "wb") as f:
            for block in iter(lambda: reply["Body"].read(BLOCK), b""):
                got += len(block)
                if got > size:
                    break
                digest.update(block)
                f.write(block)
        if got != size:
            raise ChecksumMismatch(
                f"{where} holds {'more than ' if got > size else ''}{got} bytes, its manifest {size}"
            )
        if digest.hexdigest() != sha256:
            raise ChecksumMismatch(f"{where}: sha256 {digest.hexdigest()} differs from its manifest's {sha256}")

    attempts.run(f"download of {where}", request)


def fetch_checkpoint(
    client: Any, source: S3Url, root: Path, iteration: int | None, policy: RetryPolicy
) -> tuple[str, bool]:
    """Download the checkpoint ``latest`` names (or ``iteration``'s) from ``source`` into ``root``; returns its tag
    and whether it was downloaded (False: the cached copy matched)."""
    if iteration is None:
        missing = f"{source.child(LATEST)} does not exist: no checkpoint was uploaded to {source}"
        named = _get_small(client, source.child(LATEST), Attempts(policy), missing).decode("utf-8", "replace").strip()
        if tag_iteration(named) is None:
            raise S3Error(f"{source.child(LATEST)} holds {named[:60]!r}, not a checkpoint tag global_step<N>")
        tag = named
    else:
        tag = checkpoint_tag(iteration)
    where = source.child(tag)
    missing = f"{where.child(MANIFEST)} does not exist: {where} is not a committed checkpoint"
    raw = _get_small(client, where.child(MANIFEST), Attempts(policy), missing)
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise S3Error(f"{where.child(MANIFEST)} is not a checkpoint manifest ({e})") from None
    problem = manifest_structure_problem(manifest)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if problem is None and not (isinstance(files, dict) and all(e.get("sha256") for e in files.values())):
        problem = "it lists no sha256 per file"
    if problem:
        raise S3Error(f"{where.child(MANIFEST)} is not a checkpoint manifest: {problem}")
    assert isinstance(files, dict)
    final = root / tag
    cached = (final / MANIFEST).is_file() and (final / MANIFEST).read_bytes() == raw
    if cached and verify_checkpoint(final, checksums=True) is None:
        atomic_write_text(root / LATEST, tag)
        return tag, False
    staging = root / f".partial-{tag}-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for name in sorted(files):
            if name == MANIFEST:
                continue
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            entry = files[name]
            _download(client, where.child(name), target, int(entry["size"]), str(entry["sha256"]), Attempts(policy))
        (staging / MANIFEST).write_bytes(raw)
        _replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    atomic_write_text(root / LATEST, tag)
    for old in checkpoint_dirs(root):  # a cache: only the checkpoint just fetched stays
        if old.name != tag:
            shutil.rmtree(old, ignore_errors=True)
    return tag, True


def _replace(staging: Path, final: Path) -> None:
    """Move the complete download into place (another node writing the same shared cache may have done so)."""
    if final.exists():
        trash = final.with_name(f".trash-{final.name}-{os.getpid()}")
        with contextlib.suppress(OSError):
            final.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        staging.rename(final)
    except OSError:
        if verify_checkpoint(final, checksums=True) is not None:
            raise


def download_for_load(cfg: CheckpointConfig) -> CheckpointConfig:
    """All ranks call, with ``load`` an ``s3://`` location: the first local rank of each node downloads the
    checkpoint into the cache; returns ``cfg`` with ``load`` the cache folder. Errors are one S3Error line on every
    rank."""
    assert cfg.load is not None and is_s3_url(cfg.load)
    source = parse_s3_url(cfg.load)
    root = cache_root(source, cfg.s3_cache_dir)
    iteration = int(cfg.iteration) if cfg.iteration is not None else None
    error = ""
    if mpu.local_rank() == 0:
        start = time.perf_counter()
        try:
            root.mkdir(parents=True, exist_ok=True)
            policy = retry_policy(cfg)
            tag, fetched = fetch_checkpoint(make_client(policy), source, root, iteration, policy)
            what = f"downloaded {source.child(tag)} to {root / tag} in {time.perf_counter() - start:.1f} s"
            logger.info(what if fetched else f"{source.child(tag)}: using the copy in {root / tag}")
        except S3Error as e:
            error = f"load {source}: {e}"
        except OSError as e:
            error = f"load {source}: cannot write the cache folder {root}: {e.strerror or e}"
    errors = [e for e in mpu.all_gather_objects(error) if e]
    if errors:
        raise S3Error(errors[0])
    return dataclasses.replace(cfg, load=str(root))
