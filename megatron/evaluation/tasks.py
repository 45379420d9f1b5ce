"""Resolve ``eval_tasks`` entries (lm-eval task names, glob patterns, task YAML files or folders) to task names.

A YAML file or a folder is added to lm-eval's ``include_path`` and contributes the tasks it defines; names and
globs are matched against lm-eval's registry (its bundled tasks are indexed only when a name needs them, which
takes seconds). Unknown names fail with the closest registered names.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCAL_BUILDERS = {"json", "csv", "text", "parquet", "arrow"}
OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
SHIPPED_TASKS = "configs/eval/"


@dataclass
class ResolvedTasks:
    """Task names to evaluate and the TaskManager that knows them."""

    names: list[str]
    manager: Any
    include_paths: list[str] = field(default_factory=list)

    def specs(self) -> list[str | dict[str, Any]]:
        """What to hand lm-eval: the name, or for a local task whose ``data_files`` are relative paths, its config
        with those paths made absolute against the YAML file's folder (lm-eval would use the working directory)."""
        out: list[str | dict[str, Any]] = []
        for name in self.names:
            entry = self.manager.task_index.get(name)
            cfg, yaml_path = getattr(entry, "cfg", None), getattr(entry, "yaml_path", None)
            files = ((cfg or {}).get("dataset_kwargs") or {}).get("data_files")
            if not (cfg and yaml_path and files) or str(Path(yaml_path).parent) not in self.include_paths:
                out.append(name)
                continue
            base = Path(yaml_path).parent
            kwargs = dict(cfg["dataset_kwargs"])
            kwargs["data_files"] = _absolute_files(files, base)
            out.append({**cfg, "dataset_kwargs": kwargs})
        return out


def _absolute_files(files: Any, base: Path) -> Any:
    """``data_files`` (a path, list or split → path(s) dict) with relative paths joined to ``base``."""
    if isinstance(files, dict):
        return {k: _absolute_files(v, base) for k, v in files.items()}
    if isinstance(files, list):
        return [_absolute_files(v, base) for v in files]
    path = Path(str(files))
    return str(path if path.is_absolute() or "://" in str(files) else (base / path).resolve())


def _local_task_names(path: Path) -> list[str]:
    """Tasks defined by a YAML file or by the YAML files under a folder (lm-eval's own index parses them)."""
    from lm_eval.tasks import TaskManager

    folder = path if path.is_dir() else path.parent
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    names = []
    for name, entry in manager.task_index.items():
        yaml_path = getattr(entry, "yaml_path", None)
        if name not in manager.all_subtasks and name not in manager.all_groups:
            continue
        if path.is_dir() or (yaml_path is not None and Path(yaml_path).resolve() == path.resolve()):
            names.append(name)
    if not names:
        raise ValueError(f"eval_tasks: {path} defines no lm-eval task (a YAML file with a `task:` key is expected)")
    for name in names:
        yaml_path = getattr(manager.task_index[name], "yaml_path", None)
        if yaml_path is not None:
            _refuse_python_functions(Path(yaml_path), set())
    return sorted(names)


def _tags(path: Path) -> tuple[dict[str, Any], list[str]]:
    """A task YAML read as data (``yaml.safe_load`` rules): its mapping and every ``key: !function x`` in it."""
    import yaml

    found: list[str] = []

    class Loader(yaml.SafeLoader):
        """Records custom tags instead of acting on them (lm-eval's ``!function`` imports Python)."""

    def record(loader: yaml.SafeLoader, tag: str, node: yaml.Node) -> str:
        found.append(f"!{tag} {getattr(node, 'value', '')}")
        return ""

    Loader.add_multi_constructor("!", record)
    try:
        data = yaml.load(path.read_text(), Loader=Loader)
    except (OSError, yaml.YAMLError):
        return {}, found  # lm-eval's own reader reports a malformed file
    return (data if isinstance(data, dict) else {}), found


def _refuse_python_functions(path: Path, seen: set[Path]) -> None:
    """A local task (and the files it includes) may not use ``!function``: lm-eval would import and run the folder's
    Python, and neox-forge's own reading of the task would see the function's path as a literal string."""
    path = path.resolve()
    if path in seen or not path.is_file():
        return
    seen.add(path)
    data, functions = _tags(path)
    if functions:
        raise ValueError(
            f"eval_tasks: {path} uses `{functions[0].strip()}`: local tasks with Python functions are not supported "
            "(neox-forge never runs code from a task folder); express it with Jinja templates and lm-eval's built-in "
            "metrics and filters"
        )
    includes = data.get("include") or []
    for include in includes if isinstance(includes, list) else [includes]:
        _refuse_python_functions(path.parent / str(include), seen)


def resolve_tasks(entries: list[str] | None) -> ResolvedTasks:
    """Task names and a TaskManager for ``eval_tasks``; raises ValueError naming each bad entry."""
    if not entries:
        raise ValueError(
            "eval_tasks: no tasks given; name lm-eval tasks, globs or task YAML files/folders "
            f"(e.g. --eval_tasks {SHIPPED_TASKS} for the tasks shipped with neox-forge)"
        )
    include: list[str] = []
    names: list[str] = []
    patterns: list[str] = []
    for entry in entries:
        entry = str(entry)
        path = Path(entry)
        if path.exists():
            if path.is_file() and path.suffix not in (".yaml", ".yml"):
                raise ValueError(f"eval_tasks: {entry} is a file but not a task YAML (.yaml/.yml)")
            include.append(str((path if path.is_dir() else path.parent).resolve()))
            names += _local_task_names(path)
        elif entry.endswith((".yaml", ".yml")) or os.sep in entry:
            raise ValueError(f"eval_tasks: task file or folder {entry} does not exist")
        else:
            patterns.append(entry)
    include = sorted(set(include))
    manager = _task_manager(tuple(include), bool(patterns))
    known = manager.all_tasks
    problems = []
    for pattern in patterns:
        matched = fnmatch.filter(known, pattern) if any(c in pattern for c in "*?[") else []
        if pattern in known:
            names.append(pattern)
        elif matched:
            names += sorted(matched)
        else:
            close = difflib.get_close_matches(pattern, known, n=5, cutoff=0.6)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            problems.append(f"eval_tasks: unknown lm-eval task {pattern!r}{hint}")
    if problems:
        raise ValueError("\n".join(problems))
    unique = list(dict.fromkeys(names))
    _check_offline(unique, manager)
    return ResolvedTasks(unique, manager, include)


@functools.lru_cache(maxsize=8)
def _task_manager(include: tuple[str, ...], include_defaults: bool) -> Any:
    """lm-eval's TaskManager (indexing its bundled tasks takes seconds: built once per process and include set)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None, include_defaults=include_defaults)


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_ENV)


def _check_offline(names: list[str], manager: Any) -> None:
    """Refuse, before any download attempt, tasks whose dataset lives on the Hugging Face Hub when offline."""
    if not _offline():
        return
    for name in names:
        entry = manager.task_index.get(name)
        cfg = getattr(entry, "cfg", None) or {}
        if not cfg and getattr(entry, "tags", None):  # a tag such as `lambada`: check the tasks it names
            _check_offline(sorted(entry.tags), manager)
            continue
        dataset = cfg.get("dataset_path")
        if not dataset or dataset in LOCAL_BUILDERS or Path(str(dataset)).exists() or _hub_cached(str(dataset)):
            continue
        raise ValueError(
            f"eval_tasks: task {name!r} downloads the dataset {dataset!r} from the Hugging Face Hub, but this "
            f"process is offline ({'/'.join(OFFLINE_ENV)} set) and the dataset is not in the local cache; "
            f"run it once online, or use a local task YAML with `dataset_path: json` (examples in {SHIPPED_TASKS})"
        )


def _hub_cached(dataset: str) -> bool:
    """True when the Hugging Face datasets cache already holds ``dataset`` (then offline loading works)."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    flat = dataset.replace("/", "--")
    return (hub / f"datasets--{flat}").exists() or any((home / "datasets").glob(f"{flat.replace('--', '___')}*"))
