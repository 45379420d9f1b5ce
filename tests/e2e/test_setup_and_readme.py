"""A first hour that just works: every entry point under a bare Python prints the one-line setup hint, and the
README's command blocks run as written in a fresh shell after activating ``.venv``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

ENTRY_POINTS = sorted(
    [
        "deepy.py",
        "train.py",
        "generate.py",
        "eval.py",
        "prepare_data.py",
        *(str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob("tools/**/*.py") if not p.name.startswith("_")),
    ]
)


def _bare(args: list[str], cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """The interpreter the venv was made from, without site-packages (-S) or PYTHON* variables (-E)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return subprocess.run(
        [base, "-S", "-E", *args], cwd=cwd, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
    )


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_entry_point_under_bare_python_prints_one_line_hint(script: str) -> None:
    args = (
        [script, "train.py", "configs/cpu/quickstart.yml", "--dry-run"] if script == "deepy.py" else [script, "--help"]
    )
    result = _bare(args)
    assert result.returncode == 1, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    line = lines[0]
    assert line.startswith(f"{Path(script).name}: error: this Python (")
    assert "torch" in line and "numpy" in line  # names what is missing
    assert "`bash scripts/bootstrap.sh && source .venv/bin/activate`" in line
    assert "Traceback" not in result.stderr


def test_hint_names_setup_paths_from_another_folder(tmp_path: Path) -> None:
    result = _bare([str(REPO_ROOT / "tools/ckpts/reshard_checkpoint.py"), "--help"], cwd=tmp_path)
    assert result.returncode == 1
    assert f"`bash {REPO_ROOT}/scripts/bootstrap.sh && source {REPO_ROOT}/.venv/bin/activate`" in result.stderr


def readme_commands(text: str) -> list[str]:
    """The commands of the README's ``bash`` blocks (continuation lines joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split("  #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def runnable(command: str) -> tuple[str, list[str]]:
    """The README command as the test runs it, and the flags that its tool's ``--help`` must list.

    ``bash scripts/*.sh`` is parsed (``bash -n``): the quick start, the test suite and the installer take minutes.
    ``deepy.py`` commands get ``--dry-run`` (config merging, validation and the launch plan run for real); tools
    get ``--help``, and every flag that the README passes must be one they accept."""
    words = shlex.split(command)
    if words[0] == "bash":
        return f"bash -n {shlex.quote(words[1])}", []
    if words[:2] == ["python", "deepy.py"]:
        return command if "--dry-run" in words else f"{command} --dry-run", []
    if words[0] == "python" and words[1].startswith("tools/"):
        return f"python {shlex.quote(words[1])} --help", [w for w in words[2:] if w.startswith("--")]
    return command, []


def test_readme_commands_run_as_written_after_activation() -> None:
    venv = REPO_ROOT / ".venv" / "bin" / "activate"
    if not venv.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(".venv is missing: scripts/bootstrap.sh creates it")
        pytest.skip(".venv is missing")
    commands = readme_commands((REPO_ROOT / "README.md").read_text())
    assert "source .venv/bin/activate" in commands
    assert sum(c.startswith("python deepy.py") for c in commands) >= 3
    assert sum(c.startswith("python tools/") for c in commands) >= 4
    script = ["cd " + shlex.quote(str(REPO_ROOT)), "source .venv/bin/activate"]
    expected_flags = []
    for i, command in enumerate(c for c in commands if c != "source .venv/bin/activate"):
        run, flags = runnable(command)
        expected_flags.append((command, flags))
        script += [f"echo '@@@ {i}'", f"{run} 2>&1", 'echo "@@@ rc $?"']
    # a fresh shell: nothing from this process's environment but HOME, and no Python on PATH besides the system's
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        ["bash", "-c", "\n".join(script)], env=env, capture_output=True, text=True, timeout=600, cwd="/"
    )
    outputs = re.split(r"^@@@ \d+\n", result.stdout, flags=re.M)[1:]
    assert len(outputs) == len(expected_flags), result.stdout[-3000:] + result.stderr[-3000:]
    for (command, flags), output in zip(expected_flags, outputs):
        assert output.rstrip().endswith("@@@ rc 0"), f"{command}\n{output[-3000:]}"
        assert "ModuleNotFoundError" not in output
        for flag in flags:
            assert flag in output, f"{command}: {flag} is not in the tool's --help"
        if command.startswith("python deepy.py"):
            assert "launch command" in output
