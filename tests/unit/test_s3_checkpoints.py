"""S3 checkpoint upload and download against a real S3 server on 127.0.0.1 (moto's server mode), with a fault
proxy for corrupted, truncated and slow requests and a closed port for a server that is down.

The training runs that upload and resume from S3 are in tests/e2e/test_s3_training.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from megatron.checkpoint.commit import delete_old_checkpoints
from megatron.checkpoint.manifest import verify_checkpoint, write_manifest
from megatron.checkpoint.s3_client import RetryPolicy, S3Error, make_client
from megatron.checkpoint.s3_download import cache_root, fetch_checkpoint
from megatron.checkpoint.s3_upload import S3Uploader
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.s3_checks import parse_s3_url
from tests.harness import free_port
from tests.s3_server import FaultProxy, corrupt_puts, make_bucket, moto_s3, objects, s3_env
from tests.unit.test_neox_args import CPU1, TINY

MIB = 1 << 20
FAST = RetryPolicy(attempts=3, timeout=5.0, backoff=0.05)
LOGGER = "megatron.checkpoint.s3_upload"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_s3() as url:
        yield url


@pytest.fixture
def bucket(endpoint: str, request: pytest.FixtureRequest) -> tuple[str, Any]:
    name = "t-" + hashlib.sha256(request.node.name.encode()).hexdigest()[:16]
    return name, make_bucket(endpoint, name)


def use_endpoint(monkeypatch: pytest.MonkeyPatch, url: str, tmp: Path) -> None:
    for key, value in s3_env(url, tmp).items():
        monkeypatch.setenv(key, value)


def committed_checkpoint(save: Path, tag: str, big: int = 11 * MIB) -> Path:
    """A folder as a save commits it: a file of ``big`` bytes (3 parts of 5 MiB), small ones, a manifest."""
    directory = save / tag
    (directory / "configs").mkdir(parents=True)
    (directory / "mp_rank_00_model_states.pt").write_bytes(os.urandom(big))
    (directory / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(os.urandom(3000))
    (directory / "configs" / "run.yml").write_text("train_iters: 4\n")
    write_manifest(directory, tag=tag, iteration=int(tag.removeprefix("global_step")))
    (save / "latest").write_text(tag)
    return directory


def local_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def upload(save: Path, tag: str, s3_path: str, policy: RetryPolicy = FAST, wait: float = 60) -> S3Uploader:
    uploader = S3Uploader(s3_path, str(save), 5 * MIB, policy, flush_timeout=wait)
    uploader.submit(tag)
    assert uploader.close() == []
    return uploader


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_s3_keys_are_checked_in_the_config() -> None:
    def problems(**values: Any) -> list[str]:
        with pytest.raises(ConfigError) as e:
            NeoXArgs({**TINY, "checkpoint_factor": 4, **values}, env=CPU1)
        return list(e.value.problems)

    assert problems(s3_path="bucket/prefix", save="x") == [
        "s3_path='bucket/prefix' is not an S3 location: it does not start with s3://; expected s3://bucket/prefix "
        "(bucket: 3-63 lower-case letters, digits, dots and hyphens)"
    ]
    assert "'My_Bucket' is not an S3 bucket name" in problems(s3_path="s3://My_Bucket/x", save="x")[0]
    assert "'..' component" in problems(s3_path="s3://bucket/a/../b", save="x")[0]
    assert problems(s3_path="s3://bucket/runs") == ["s3_path='s3://bucket/runs' uploads the checkpoints of save, but save is not set"]  # fmt: skip
    assert problems(load="s3://b") == [
        "load='s3://b' is not an S3 location: 'b' is not an S3 bucket name; expected s3://bucket/prefix (bucket: 3-63 "
        "lower-case letters, digits, dots and hyphens)"
    ]
    assert problems(s3_chunk_size=1024) == ["s3_chunk_size=1024 must be between 5242880 and 5368709120"]
    assert problems(s3_path="s3://bucket/runs", save="x", s3_flush_timeout=600) == [
        "s3_flush_timeout=600.0 must be shorter than distributed_timeout_minutes=10.0 (default) (in seconds: 600): the "
        "other ranks wait for rank 0's uploads at the end of training"
    ]
    ok = {"s3_path": "s3://bucket/runs/", "save": "x", "checkpoint_factor": 4, "load": "s3://bucket/runs/x"}
    args = NeoXArgs({**TINY, **ok}, env=CPU1)
    assert args.s3_chunk_size == 104857600 and parse_s3_url(args.s3_path).key("x") == "runs/x"


def test_committed_checkpoint_uploads_in_verified_parts(
    bucket: tuple[str, Any], endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, client = bucket
    use_endpoint(monkeypatch, endpoint, tmp_path)
    directory = committed_checkpoint(tmp_path / "run1", "global_step4")
    before = local_files(directory)
    uploader = upload(tmp_path / "run1", "global_step4", f"s3://{name}/runs")
    [report] = uploader.reports
    assert report.ok and report.files == 4 and report.retries == []
    stored = objects(client, name)
    assert stored == {
        **{f"runs/run1/global_step4/{k}": v for k, v in before.items()},
        "runs/run1/latest": b"global_step4",
    }
    # the 11 MiB file went up in three parts of s3_chunk_size (S3's multipart ETag: md5 of the part md5s, -N)
    big = client.head_object(Bucket=name, Key="runs/run1/global_step4/mp_rank_00_model_states.pt")
    assert big["ETag"].strip('"').endswith("-3") and big["ContentLength"] == 11 * MIB
    assert local_files(directory) == before  # nothing local is written


@pytest.mark.parametrize(
    ("truncate", "min_size", "what"),
    [(False, MIB, "part 1 of"), (True, 1, "upload of")],
    ids=["corrupted-part", "truncated-file"],
)
def test_corrupted_or_partial_requests_are_detected_and_sent_again(
    bucket: tuple[str, Any],
    endpoint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    truncate: bool,
    min_size: int,
    what: str,
) -> None:
    name, client = bucket
    directory = committed_checkpoint(tmp_path / "run", "global_step8")
    with FaultProxy(endpoint) as proxy:
        use_endpoint(monkeypatch, proxy.endpoint, tmp_path)
        # twice: the first request and its first retry (the third of FAST's attempts gets through)
        proxy.tamper = corrupt_puts(2, truncate=truncate, min_size=min_size)
        uploader = upload(tmp_path / "run", "global_step8", f"s3://{name}/r")
    [report] = uploader.reports
    assert report.ok and len(report.retries) == 2
    for retry in report.retries:
        assert retry.startswith(what) and "is not the MD5" in retry and "of the bytes sent" in retry
    stored = objects(client, name, "r/run/global_step8/")
    assert stored == {f"r/run/global_step8/{k}": v for k, v in local_files(directory).items()}


def test_an_upload_that_keeps_failing_is_one_line_and_leaves_the_checkpoint(
    bucket: tuple[str, Any], endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    name, client = bucket
    directory = committed_checkpoint(tmp_path / "run", "global_step2", big=6 * MIB)  # a multipart upload
    before = local_files(directory)
    with FaultProxy(endpoint) as proxy, caplog.at_level(logging.INFO):
        use_endpoint(monkeypatch, proxy.endpoint, tmp_path)
        proxy.tamper = corrupt_puts(None)  # every request: no attempt can succeed
        start = time.perf_counter()
        uploader = upload(tmp_path / "run", "global_step2", f"s3://{name}/r")
        elapsed = time.perf_counter() - start
    [report] = uploader.reports
    assert not report.ok and elapsed < 10
    [line] = errors(caplog)
    assert line.startswith(f"S3 upload of checkpoint {directory} to s3://{name}/r/run/global_step2 failed after ")
    assert "training continues (the local checkpoint is intact)" in line and "(after 3 attempts)" in line
    assert "\n" not in line and "Traceback" not in caplog.text
    assert "r/run/latest" not in objects(client, name)  # a reader of latest never sees this checkpoint
    assert local_files(directory) == before and verify_checkpoint(directory, checksums=True) is None
    assert client.list_multipart_uploads(Bucket=name).get("Uploads", []) == []  # the unfinished one was aborted


def test_server_down_fails_within_the_retry_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    use_endpoint(monkeypatch, f"http://127.0.0.1:{free_port()}", tmp_path)  # nothing listens there
    directory = committed_checkpoint(tmp_path / "run", "global_step2", big=1000)
    before = local_files(directory)
    with caplog.at_level(logging.INFO):
        start = time.perf_counter()
        upload(tmp_path / "run", "global_step2", "s3://bucket/r")
        elapsed = time.perf_counter() - start
    [line] = errors(caplog)
    assert "Could not connect to the endpoint URL" in line and "(after 3 attempts)" in line and elapsed < 10
    assert local_files(directory) == before


def test_an_error_no_retry_fixes_ends_the_upload_at_once(
    endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_endpoint(monkeypatch, endpoint, tmp_path)
    committed_checkpoint(tmp_path / "run", "global_step2", big=10)
    slow_retries = RetryPolicy(attempts=5, timeout=5.0, backoff=10.0)
    start = time.perf_counter()
    [report] = upload(tmp_path / "run", "global_step2", "s3://no-such-bucket/r", slow_retries).reports
    assert time.perf_counter() - start < 5 and not report.ok  # no 10 s wait before a second try
    assert report.error.endswith("NoSuchBucket: The specified bucket does not exist")


def test_slow_server_does_not_block_and_the_flush_wait_is_bounded(
    bucket: tuple[str, Any], endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    name, client = bucket
    committed_checkpoint(tmp_path / "run", "global_step2", big=1000)
    committed_checkpoint(tmp_path / "run", "global_step4", big=1000)
    with FaultProxy(endpoint) as proxy, caplog.at_level(logging.INFO):
        use_endpoint(monkeypatch, proxy.endpoint, tmp_path)
        proxy.delay = 0.1  # each request: 9 per checkpoint (4 files, each checked, and latest)
        uploader = S3Uploader(f"s3://{name}/r", str(tmp_path / "run"), 5 * MIB, FAST, flush_timeout=30)
        start = time.perf_counter()
        uploader.submit("global_step2")
        assert time.perf_counter() - start < 0.05  # training goes on while it uploads
        assert uploader.pending() == ["global_step2"]
        assert uploader.close() == [] and time.perf_counter() - start > 0.9
        assert "waiting up to 30 s (s3_flush_timeout) for the S3 upload of global_step2" in caplog.text
        assert "S3 uploads finished after" in caplog.text
        # slower than s3_timeout: each request times out, the upload is given up
        proxy.delay = 1.0
        slow = RetryPolicy(attempts=2, timeout=0.3, backoff=0.05)
        uploader = S3Uploader(f"s3://{name}/r", str(tmp_path / "run"), 5 * MIB, slow, flush_timeout=0.3)
        uploader.submit("global_step4")
        assert uploader.close() == ["global_step4"]  # the flush wait ends first, naming what is not uploaded
        assert "S3: gave up waiting after 0.3 s (s3_flush_timeout); not uploaded: global_step4" in caplog.text
        uploader._thread.join(10)
    assert not uploader.reports[0].ok and "Read timeout" in uploader.reports[0].error
    assert objects(client, name, "r/run/latest") == {"r/run/latest": b"global_step2"}


def test_download_checks_every_file_against_the_manifest(
    bucket: tuple[str, Any], endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, client = bucket
    use_endpoint(monkeypatch, endpoint, tmp_path)
    directory = committed_checkpoint(tmp_path / "run", "global_step6", big=1000)
    upload(tmp_path / "run", "global_step6", f"s3://{name}/p")
    source = parse_s3_url(f"s3://{name}/p/run")
    root = cache_root(source, str(tmp_path / "cache"))
    assert root == tmp_path / "cache" / name / "p" / "run"
    s3 = make_client(FAST)
    assert fetch_checkpoint(s3, source, root, None, FAST) == ("global_step6", True)
    assert local_files(root / "global_step6") == local_files(directory)
    assert (root / "latest").read_text() == "global_step6"
    assert fetch_checkpoint(s3, source, root, 6, FAST) == ("global_step6", False)  # the cached copy is used
    # an object changed after the upload (same size): its sha256 is not the manifest's
    key = "p/run/global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    client.put_object(Bucket=name, Key=key, Body=os.urandom(3000))
    with pytest.raises(S3Error, match=r"optim_states.pt: sha256 [0-9a-f]{64} differs from its manifest's .* attempts"):
        fetch_checkpoint(s3, source, tmp_path / "cache2", None, FAST)
    assert not (tmp_path / "cache2" / "global_step6").exists()
    with pytest.raises(S3Error, match=rf"s3://{name}/p/other/latest does not exist: no checkpoint was uploaded"):
        fetch_checkpoint(s3, parse_s3_url(f"s3://{name}/p/other"), tmp_path / "c3", None, FAST)
    client.put_object(Bucket=name, Key="p/run/latest", Body=b"../../etc")
    with pytest.raises(S3Error, match=re.escape("holds '../../etc', not a checkpoint tag")):
        fetch_checkpoint(s3, source, tmp_path / "c4", None, FAST)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"] = {"../escape": {"size": 1, "sha256": "0" * 64}}
    client.put_object(Bucket=name, Key="p/run/global_step6/manifest.json", Body=json.dumps(manifest).encode())
    with pytest.raises(S3Error, match="is not a relative path inside the checkpoint folder"):
        fetch_checkpoint(s3, source, tmp_path / "c5", 6, FAST)


def test_credentials_come_from_the_environment_or_the_aws_files(
    bucket: tuple[str, Any], endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, client = bucket
    use_endpoint(monkeypatch, endpoint, tmp_path)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(S3Error, match=r"^no AWS credentials found for S3: set AWS_ACCESS_KEY_ID"):
        make_client(FAST)
    credentials = tmp_path / "credentials"
    credentials.write_text("[default]\naws_access_key_id = AKIAFILE\naws_secret_access_key = from-the-file\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    committed_checkpoint(tmp_path / "run", "global_step1", big=10)
    assert upload(tmp_path / "run", "global_step1", f"s3://{name}").reports[0].ok
    assert objects(client, name, "run/latest") == {"run/latest": b"global_step1"}


def test_missing_boto3_is_a_one_line_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
    with pytest.raises(S3Error) as e:
        make_client(FAST)
    assert str(e.value) == (
        "the S3 keys need the boto3 package, which is not installed: pip install -r requirements/requirements-s3.txt"
    )


def test_retention_keeps_a_checkpoint_until_its_upload_ends(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        committed_checkpoint(tmp_path, f"global_step{step}", big=10)
    deleted = delete_old_checkpoints(tmp_path, 1, keep=["global_step2"])
    assert [p.name for p in deleted] == ["global_step4"]
    assert delete_old_checkpoints(tmp_path, 1) == [tmp_path / "global_step2"]


def test_generation_refuses_an_s3_load_in_one_line() -> None:
    from megatron.generation.config import InferenceConfig

    cfg = InferenceConfig.from_neox_args(NeoXArgs({**TINY, "load": "s3://bucket/runs/x"}, env=CPU1))
    with pytest.raises(ConfigError, match=r"^load='s3://bucket/runs/x': generation and evaluation read a local"):
        cfg.checkpoint_dir  # noqa: B018
