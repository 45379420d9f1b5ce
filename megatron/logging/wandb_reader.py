"""Read the logged rows back from an offline W&B run file (``run-<id>.wandb``).

The file is a LevelDB-log-style stream: a 7-byte header ``<4sHB`` (``b":W&B"``, 0xBEE1, 0), then 32 KiB blocks
of records, each with a 7-byte header ``<IHB`` (crc32, length, type 1=FULL 2=FIRST 3=MIDDLE 4=LAST) whose payloads
(joined across FIRST..LAST) are ``wandb_internal_pb2.Record`` messages; ``history`` records hold the rows.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7


def _payloads(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (missing ':W&B' magic)")
    out: list[bytes] = []
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        block_left = _BLOCK - (pos % _BLOCK)
        if block_left < _HEADER:  # block trailer padding
            pos += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        chunk = data[pos : pos + length]
        pos += length
        if kind == 0 and length == 0:
            pos += _BLOCK - (pos % _BLOCK) if pos % _BLOCK else 0
            continue
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
            pending = b""
    return out


def _records(run_file: str | Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    records = []
    for payload in _payloads(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def read_wandb_history(run_file: str | Path, wait_s: float = 30.0) -> list[dict[str, Any]]:
    """Every logged row of the run as a dict (values JSON-decoded; ``_step`` included).

    W&B's background service may still be writing when ``finish()`` returns or the process exits, so this waits
    (up to ``wait_s``) for the run's final ``exit`` record.
    """
    deadline = time.monotonic() + wait_s
    records = _records(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = _records(run_file)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def find_run_files(root: str | Path) -> list[Path]:
    """All ``run-*.wandb`` files under ``root`` (offline runs)."""
    return sorted(Path(root).rglob("run-*.wandb"))
