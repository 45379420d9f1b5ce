"""Secrets (API keys, tokens) on their way to the ranks: never on a command line, never in a log line.

Variables whose names look secret (``WANDB_API_KEY``, ``HF_TOKEN``, ``*_PASSWORD`` ...) travel through the
environment of the launcher process (``srun --export=ALL``, ``mpirun -x NAME``) or, for ssh-based launches (pdsh),
through an environment file that only the user can read. Their values are replaced by ``***`` in every log record
and in every printed command.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import Iterable, Mapping

SECRET_NAME = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY|AUTH)", re.IGNORECASE)
MASK = "***"
_MIN_LEN = 4  # shorter values would mask ordinary words and numbers


def is_secret_name(name: str) -> bool:
    """True for variable names that hold credentials."""
    return bool(SECRET_NAME.search(name))


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The values of secret-named variables in ``env`` (default: this process's environment), longest first."""
    env = os.environ if env is None else env
    values = {v for k, v in env.items() if is_secret_name(k) and len(v) >= _MIN_LEN}
    return sorted(values, key=len, reverse=True)


def redact(text: str, env: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> str:
    """``text`` with every secret value (from ``env`` and ``extra``) replaced by ``***``."""
    for value in [*secret_values(env), *extra]:
        if value:
            text = text.replace(value, MASK)
    return text


def _mask_record(record: logging.LogRecord) -> None:
    if not secret_values():
        return
    try:
        message = record.getMessage()
    except (TypeError, ValueError):  # a malformed format: logging reports it when the record is emitted
        return
    masked = redact(message)
    if masked != message:
        record.msg, record.args = masked, None


class RedactingFilter(logging.Filter):
    """A logging filter that masks secret values (read from the environment at each record) in the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        _mask_record(record)
        return True


def install_log_redaction() -> None:
    """Mask secrets in every log record of this process, whatever its logger and handlers (DeepSpeed's logger
    does not propagate to the root logger): the record factory masks each record as it is created."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "redacting", False):
        return

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        _mask_record(record)
        return record

    factory.redacting = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def write_env_file(path: str, env: Mapping[str, str]) -> None:
    """Write ``NAME='value'`` lines (for ``set -a; . FILE``) into a new file readable only by this user."""
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for name, value in sorted(env.items()):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"environment variable name {name!r} cannot be exported by a shell")
            f.write(f"{name}={shlex.quote(value)}\n")
