"""S3 locations (``s3_path``, ``load: s3://...``): their syntax, and the config rules of the S3 keys.

The one parser of ``s3://bucket/prefix`` (:func:`parse_s3_url`) lives here, below the checkpoint code that uploads
and downloads (standard library only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SCHEME = "s3://"
# S3's bucket names: 3-63 lower-case letters, digits, dots and hyphens, starting and ending with a letter or digit
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
EXPECTED = "expected s3://bucket/prefix (bucket: 3-63 lower-case letters, digits, dots and hyphens)"


@dataclass(frozen=True)
class S3Url:
    """An ``s3://bucket/prefix`` location: ``prefix`` without leading or trailing ``/`` (may be empty)."""

    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under the prefix, joined with ``/``."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def child(self, *parts: str) -> S3Url:
        """The location ``parts`` below this one."""
        return S3Url(self.bucket, self.key(*parts))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


def is_s3_url(value: Any) -> bool:
    """True for a string that starts with ``s3://`` (valid or not)."""
    return isinstance(value, str) and value.startswith(SCHEME)


def s3_url_problem(value: Any) -> str | None:
    """What is wrong with ``value`` as an S3 location (None: it is one)."""
    if not isinstance(value, str) or not value.startswith(SCHEME):
        return f"it does not start with {SCHEME}; {EXPECTED}"
    bucket, _, prefix = value[len(SCHEME) :].partition("/")
    if not BUCKET_RE.match(bucket) or ".." in bucket:
        return f"{bucket!r} is not an S3 bucket name; {EXPECTED}"
    parts = prefix.strip("/").split("/") if prefix.strip("/") else []
    if any(p in ("", ".", "..") for p in parts):
        return f"the prefix {prefix!r} has an empty, '.' or '..' component; {EXPECTED}"
    if any(ord(ch) < 32 or ch == "\\" for ch in prefix):
        return f"the prefix {prefix!r} holds a control character or a backslash; {EXPECTED}"
    return None


def parse_s3_url(value: str) -> S3Url:
    """``s3://bucket/prefix`` → :class:`S3Url`; a ValueError saying what is wrong otherwise."""
    problem = s3_url_problem(value)
    if problem:
        raise ValueError(f"{value!r} is not an S3 location: {problem}")
    bucket, _, prefix = value[len(SCHEME) :].partition("/")
    return S3Url(bucket, prefix.strip("/"))


def s3_problems(values: dict[str, Any], at: Any) -> list[str]:
    """The S3 keys' rules; ``at(key)`` names a key with its value and file."""
    out = []
    s3_path, load = values["s3_path"], values["load"]
    if s3_path is not None:
        problem = s3_url_problem(s3_path)
        if problem:
            out.append(f"{at('s3_path')} is not an S3 location: {problem}")
        elif not values["save"]:
            out.append(f"{at('s3_path')} uploads the checkpoints of save, but save is not set")
    if is_s3_url(load):
        problem = s3_url_problem(load)
        if problem:
            out.append(f"{at('load')} is not an S3 location: {problem}")
    flush, dist_minutes = values["s3_flush_timeout"], values["distributed_timeout_minutes"]
    numbers = isinstance(flush, int | float) and isinstance(dist_minutes, int | float)
    if s3_path is not None and numbers and flush >= dist_minutes * 60:
        out.append(
            f"{at('s3_flush_timeout')} must be shorter than {at('distributed_timeout_minutes')} (in seconds: "
            f"{dist_minutes * 60:g}): the other ranks wait for rank 0's uploads at the end of training"
        )
    return out
