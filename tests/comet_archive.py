"""Reads back what ``comet_ml`` wrote for an offline experiment (tests only): the archive's ``experiment.json`` and
the messages of its ``messages.json`` (one JSON message per line), by kind."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any


def read_offline_archive(path: Path) -> dict[str, Any]:
    """``experiment`` (project, workspace, tags), ``metrics`` (name -> [(step, value)] in logged order),
    ``parameters`` (name -> value) and ``others`` (name -> value) of the archive at ``path``."""
    with zipfile.ZipFile(path) as z:
        experiment = json.loads(z.read("experiment.json"))
        lines = z.read("messages.json").decode().splitlines()
    messages: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        message = json.loads(line)
        messages.setdefault(message["type"], []).append(message["payload"])
    metrics: dict[str, list[tuple[int | None, Any]]] = {}
    for m in messages.get("metric_msg", []):
        metric = m["metric"]
        metrics.setdefault(metric["metricName"], []).append((metric["step"], metric["metricValue"]))
    return {
        "experiment": experiment,
        "metrics": metrics,
        # a parameter is "param" (or "params" for a list value)
        "parameters": {
            p["paramName"]: p["paramValue"]
            for m in messages.get("parameter_msg", [])
            for p in [m.get("param") or m["params"]]
        },
        "others": {o["key"]: o["value"] for o in messages.get("log_other", [])},
    }


def archive_contains(path: Path, needle: bytes) -> bool:
    """Whether any member of the archive holds ``needle``."""
    with zipfile.ZipFile(path) as z:
        return any(needle in z.read(name) for name in z.namelist())
