"""A local eval task folder using lm-eval's ``!function`` tag, through ``deepy.py eval.py``: refused with one line
naming the task file; the folder's Python never runs and no results file is written."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.eval_fixture import REPO, build_tiny_model
from tests.harness import free_port, run_command

pytestmark = pytest.mark.distributed

UTILS = """from pathlib import Path
Path({marker!r}).write_text("the task folder's code ran")


def process_docs(dataset):
    return dataset
"""


def _task_folder(tmp_path: Path, marker: Path, included: bool) -> tuple[Path, Path]:
    """A copy of the shipped multiple-choice task whose YAML (or a file it includes) has a ``!function`` and whose
    folder holds the ``utils.py`` it names (which would write ``marker``); returns (folder, file with the tag)."""
    tasks = tmp_path / "tasks"
    shutil.copytree(REPO / "configs" / "eval" / "data", tasks / "data")
    task = {**yaml.safe_load((REPO / "configs" / "eval" / "forge_mc.yaml").read_text()), "task": "my_mc"}
    function_line = "process_docs: !function utils.process_docs\n"
    if included:  # the tag sits in a file the task includes (outside the folder handed to eval_tasks)
        bad = tmp_path / "base.yaml"
        bad.write_text(function_line)
        (tasks / "my_mc.yaml").write_text(yaml.safe_dump({**task, "include": "../base.yaml"}))
    else:
        bad = tasks / "my_mc.yaml"
        bad.write_text(yaml.safe_dump(task) + function_line)
    (tasks / "utils.py").write_text(UTILS.format(marker=str(marker)))
    return tasks, bad


def test_task_with_python_function_is_refused_by_eval_py(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    tasks, bad = _task_folder(tmp_path, marker, included=False)
    tiny = build_tiny_model(tmp_path / "model", setup="eval_results_prefix: hostile\n")
    cfg: dict = {}
    for name in tiny.configs:
        cfg.update(yaml.safe_load(Path(name).read_text()))
    cfg.pop("global_num_gpus")
    cfg.update(num_gpus=1, master_port=free_port())
    config = tmp_path / "eval.yml"
    config.write_text(yaml.safe_dump(cfg))
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(REPO / "deepy.py"), str(REPO / "eval.py"), str(config), "--eval_tasks", str(tasks)]
    result = run_command(cmd, timeout=400, cwd=tmp_path, env=env, check=False)
    assert result.returncode != 0, result.describe()
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert errors and "Traceback" not in result.stderr, result.describe()
    assert f"{bad} uses `!function utils.process_docs`" in errors[0], result.describe()
    assert "local tasks with Python functions are not supported" in errors[0]
    assert not marker.exists() and not list(tmp_path.glob("hostile_eval_results_*.json"))


def test_function_in_an_included_file_is_refused(tmp_path: Path) -> None:
    from megatron.evaluation.tasks import resolve_tasks

    marker = tmp_path / "MARKER"
    tasks, bad = _task_folder(tmp_path, marker, included=True)
    with pytest.raises(ValueError, match="local tasks with Python functions are not supported") as err:
        resolve_tasks([str(tasks)])
    assert f"{bad} uses `!function utils.process_docs`" in str(err.value)
    assert not marker.exists()
    (tmp_path / "base.yaml").write_text("description: plain data\n")  # without the tag the same folder is fine
    assert resolve_tasks([str(tasks)]).names == ["my_mc"]
