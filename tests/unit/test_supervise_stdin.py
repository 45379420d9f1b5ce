"""The launcher supervisor passes stdin on to the ranks' process group: a file or pipe as it is, a terminal's lines
through a pipe (a background process group reading the terminal would be stopped)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.launcher.supervise import Supervisor

ECHO = [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write(sys.stdin.read())"]


@pytest.mark.launches  # supervise() starts a Python child
def test_a_file_on_stdin_reaches_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond\n")
    out = tmp_path / "out.txt"
    with prompts.open() as f:
        monkeypatch.setattr(sys, "stdin", f)
        saved = os.dup(0)  # the child inherits fd 0 of this process: point it at the file
        os.dup2(f.fileno(), 0)
        try:
            assert Supervisor([*ECHO, str(out)]).run() == 0
        finally:
            os.dup2(saved, 0)
            os.close(saved)
    assert out.read_text() == "first\nsecond\n"


@pytest.mark.launches  # supervise() starts a Python child
def test_a_terminals_lines_are_relayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    master, slave = pty.openpty()
    out = tmp_path / "out.txt"
    with os.fdopen(slave, "r", closefd=True) as terminal:
        monkeypatch.setattr(sys, "stdin", terminal)
        os.write(master, b"a prompt\n\x04")  # a line, then Ctrl-D: end of input
        code = Supervisor([*ECHO, str(out)]).run()
    os.close(master)
    assert code == 0
    assert out.read_text() == "a prompt\n"


def test_without_stdin_the_child_sees_end_of_input(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from megatron.launcher.supervise import Supervisor; Supervisor({[*ECHO, str(out)]!r}).run()",
        ],
        stdin=subprocess.DEVNULL,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.returncode == 0 and out.read_text() == ""
