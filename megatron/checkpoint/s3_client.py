"""The S3 client of checkpoint uploads and downloads, and their bounded retries.

boto3 is an optional package (``requirements/requirements-s3.txt``), imported only here and only when an S3 key is
used. The endpoint and the credentials are boto3's own: the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, ...) or the AWS config
files (``~/.aws/credentials``, ``~/.aws/config``); no config key, command line or log line carries them. boto3's own
retries are off: each request is tried ``s3_upload_attempts`` times here, with exponential backoff, and bounded in
time by ``s3_timeout`` per connect and read.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from megatron.checkpoint.layout import CheckpointError

logger = logging.getLogger(__name__)

T = TypeVar("T")

INSTALL_HINT = "pip install -r requirements/requirements-s3.txt"
# errors no retry can fix: given up at once
FATAL_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "InvalidBucketName",
        "NoSuchBucket",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
    }
)


class S3Error(CheckpointError):
    """An S3 transfer that failed for good (its message is one line)."""


class ChecksumMismatch(Exception):
    """What the server holds is not what was sent (or what a manifest records); retried like a network error."""


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries of each request, ``backoff`` × 2^k seconds (at most ``max_backoff``) between them, and
    ``timeout`` seconds for each connect and read."""

    attempts: int = 5
    timeout: float = 60.0
    backoff: float = 0.5
    max_backoff: float = 30.0

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure."""
        return float(min(self.backoff * 2 ** (failures - 1), self.max_backoff))


def make_client(policy: RetryPolicy) -> Any:
    """A boto3 S3 client with boto3's retries off, our timeouts, and no checksum headers boto3 would add on its
    own (we send Content-MD5 and check ETags); a one-line S3Error when boto3 is missing or no credentials exist."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise S3Error(f"the S3 keys need the boto3 package, which is not installed: {INSTALL_HINT}") from None
    session = boto3.session.Session()
    if session.get_credentials() is None:
        raise S3Error(
            "no AWS credentials found for S3: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the "
            "environment, or write them to ~/.aws/credentials"
        )
    config = Config(
        connect_timeout=policy.timeout,
        read_timeout=policy.timeout,
        retries={"max_attempts": 1, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return session.client("s3", config=config)


def endpoint_of(client: Any) -> str:
    """The client's endpoint URL without user information (for log lines)."""
    parts = urlsplit(str(client.meta.endpoint_url))
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def md5_b64(digest: bytes) -> str:
    """The Content-MD5 header value of an MD5 digest."""
    return base64.b64encode(digest).decode("ascii")


def composite_etag(part_digests: list[bytes]) -> str:
    """The ETag S3 gives an object: the MD5 of its bytes for one request, ``md5(concatenated part MD5s)-N`` for a
    multipart upload of N parts."""
    if len(part_digests) == 1:
        return part_digests[0].hex()
    return f"{hashlib.md5(b''.join(part_digests)).hexdigest()}-{len(part_digests)}"


def error_code(error: BaseException) -> str | None:
    """The S3 error code of a botocore ClientError (None for any other error)."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


def describe(error: BaseException) -> str:
    """One line saying what went wrong (an S3 error's code and message, else the exception's text)."""
    code = error_code(error)
    if code is not None:
        message = getattr(error, "response", {}).get("Error", {}).get("Message") or ""
        text = f"{code}: {message}" if message else code
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())


def _retryable() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError, OSError, ChecksumMismatch)


class Attempts:
    """The retry budget of one file: every failed request (or failed check) spends one of ``policy.attempts``; when
    they are spent, or on an error no retry fixes, an S3Error says what failed and why."""

    def __init__(self, policy: RetryPolicy, sleep: Callable[[float], None] = time.sleep) -> None:
        self.policy = policy
        self.failures = 0
        self.retries: list[str] = []
        self._sleep = sleep

    def run(self, what: str, request: Callable[[], T]) -> T:
        """``request()``, retried after retryable failures while attempts are left."""
        errors = _retryable()
        while True:
            try:
                return request()
            except errors as e:
                self.failed(what, e)

    def failed(self, what: str, error: BaseException) -> None:
        """Count a failure of ``what``: wait before the next attempt, or raise S3Error when none is left."""
        self.failures += 1
        reason = describe(error)
        if error_code(error) in FATAL_CODES:
            raise S3Error(f"{what}: {reason}") from None
        if self.failures >= self.policy.attempts:
            raise S3Error(f"{what}: {reason} (after {self.failures} attempts)") from None
        self.retries.append(f"{what}: {reason}")
        delay = self.policy.delay(self.failures)
        logger.debug("S3: %s failed (%s); retrying in %.1f s", what, reason, delay)
        self._sleep(delay)
