"""The checkpoint reader under random damage: rank function of ``tests/e2e/test_checkpoint_fuzz.py``.

Each case copies a real checkpoint folder, applies 1-3 random mutations (truncate, flip bytes, delete a file,
replace a JSON / YAML / pickled value with a value of another type, rewrite ``latest``) and reads it as a resume and
the tools do. The read must succeed or raise the project's one-line error (``UserError``: ``CheckpointError``,
``ConfigError``), never another exception, never hang (a watchdog kills the rank after ``CASE_TIMEOUT`` seconds
with every thread's stack), and never change a file that was there (sha256 of the tree before and after).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import random
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import yaml

CASE_TIMEOUT = 60.0
ODD_VALUES: list[Any] = [
    None, True, -1, 0, 2**64, 10**30, 1.5, float("inf"), float("nan"), "", "x", "../../etc/passwd", "/etc/passwd",
    [], [1, "a"], {}, {"size": -5}, {"a": {"b": None}},
]  # fmt: skip
LATEST_VALUES: list[bytes] = [
    b"", b".", b"..", b"global_step1", b"global_step99", b"../x", b"/etc", b"global_step2/..", b"\xff\xfe\x00",
    b"global_step1\n\n", b"g" * 5000, b"global_step2\x00",
]  # fmt: skip


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (symlinks by their target), by relative path."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(root))] = f"-> {path.readlink()}"
        elif path.is_file():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _containers(obj: Any, depth: int = 0) -> list[tuple[Any, Any]]:
    """Every ``(container, key)`` slot inside nested dicts and lists."""
    slots: list[tuple[Any, Any]] = []
    if depth > 12:
        return slots
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in list(items):
        slots.append((obj, key))
        slots.extend(_containers(value, depth + 1))
    return slots


def _replace_value(obj: Any, rng: random.Random) -> str:
    slots = _containers(obj)
    if not slots:
        return "nothing to replace"
    container, key = rng.choice(slots)
    value = rng.choice(ODD_VALUES)
    container[key] = value
    return f"[{key!r}] = {value!r}"


def mutate(root: Path, rng: random.Random) -> str:
    """One random mutation of the files under ``root``; returns what it did."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file()]
    path = rng.choice(files)
    name = str(path.relative_to(root))
    kind = rng.choice(["truncate", "flip", "delete", "value", "value", "latest"])
    if kind == "latest":
        value = rng.choice(LATEST_VALUES)
        (root / "latest").write_bytes(value)
        return f"latest = {value[:20]!r}"
    if kind == "truncate":
        size = path.stat().st_size
        path.write_bytes(path.read_bytes()[: rng.randrange(size + 1) if size else 0])
        return f"truncate {name}"
    if kind == "flip":
        data = bytearray(path.read_bytes())
        for _ in range(rng.randint(1, 8)):
            if data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"flip {name}"
    if kind == "delete":
        path.unlink()
        return f"delete {name}"
    try:
        if path.suffix == ".json":
            obj = json.loads(path.read_text())
            what = _replace_value(obj, rng)
            path.write_text(json.dumps(obj))
        elif path.suffix in (".yml", ".yaml"):
            obj = yaml.safe_load(path.read_text())
            what = _replace_value(obj, rng)
            path.write_text(yaml.safe_dump(obj))
        elif path.suffix == ".pt":
            obj = torch.load(path, map_location="cpu", weights_only=False)
            what = _replace_value(obj, rng)
            torch.save(obj, path)
        else:
            return f"nothing ({name})"
    except Exception:  # damaged by an earlier mutation of this case: nothing to parse
        return f"nothing ({name} unparsable)"
    return f"{name}{what}"


def read_like_a_resume(root: Path) -> str:
    """What a resume and the checkpoint tools read: the checkpoint to load, its manifest and finite tensors, the
    weights with the saved config, and the optimizer state per parameter."""
    from megatron.checkpoint import CheckpointConfig
    from megatron.checkpoint.layout import CheckpointError
    from megatron.checkpoint.loadable import load_problem
    from megatron.checkpoint.reader import read_checkpoint
    from megatron.checkpoint.reshard import gather_full_optimizer_state
    from megatron.checkpoint.resume import resolve_tag

    tag = resolve_tag(CheckpointConfig(load=str(root)))
    if tag is None:
        return "no checkpoint"
    problem = load_problem(root / tag)
    if problem is not None:
        raise CheckpointError(problem)
    ckpt = read_checkpoint(root / tag)
    gather_full_optimizer_state(ckpt)
    return f"loaded {tag}"


def fuzz_reader(pristine: str, work: str, seed: int, cases: int) -> dict[str, Any]:
    """Run ``cases`` mutated copies of ``pristine``; returns the outcomes and every violation found."""
    from megatron.errors import UserError

    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    violations: list[str] = []
    slowest = 0.0
    for case in range(cases):
        root = Path(work) / f"case{case}"
        shutil.copytree(pristine, root, symlinks=True)
        done = [mutate(root, rng) for _ in range(rng.randint(1, 3))]
        before = tree_hashes(root)
        faulthandler.dump_traceback_later(CASE_TIMEOUT, exit=True, file=sys.stderr)
        start = time.perf_counter()
        try:
            outcome = read_like_a_resume(root)
        except UserError as e:
            outcome = "error"
            if "\n" in str(e):
                violations.append(f"case {case} {done}: a multi-line error: {e}")
        except Exception as e:  # the property under test: no other exception escapes the reader
            outcome = type(e).__name__
            violations.append(f"case {case} {done}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}")
        finally:
            faulthandler.cancel_dump_traceback_later()
        slowest = max(slowest, time.perf_counter() - start)
        if tree_hashes(root) != before:
            violations.append(f"case {case} {done}: the read changed the files")
        outcomes[outcome.split(" ")[0]] = outcomes.get(outcome.split(" ")[0], 0) + 1
        shutil.rmtree(root)
    return {"outcomes": outcomes, "violations": violations, "slowest": slowest}
