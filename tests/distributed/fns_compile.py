"""``torch_compile`` runs on a gloo rank (for tests/e2e/test_train_compile.py)."""

from __future__ import annotations

import logging
from typing import Any

from tests.distributed.fns_train import run_pretrain


def run_pretrain_with_log(config: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_pretrain`, plus the ``megatron.train`` log messages of the run."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    log = logging.getLogger("megatron.train")
    handler, level = Keep(level=logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return {**run_pretrain(config), "log": messages}
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def run_pretrain_with_log_many(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`run_pretrain_with_log` for each config, one after the other on the same rank."""
    return [run_pretrain_with_log(config) for config in configs]
