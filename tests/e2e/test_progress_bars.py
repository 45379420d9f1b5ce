"""Progress bars go to stderr, are drawn only on a terminal, and ``--quiet`` turns them off."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
from pathlib import Path

import pytest

from megatron.logging import progress as progress_mod
from tests.harness import PYTHON, REPO_ROOT, subprocess_env


def _run(args: list[str], stderr_tty: bool) -> tuple[int, str, str]:
    """Run a tool with stdout a pipe and stderr a pseudo-terminal (or a pipe); returns (rc, stdout, stderr)."""
    if not stderr_tty:
        r = subprocess.run(args, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
        return r.returncode, r.stdout, r.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other end was closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = proc.stdout.read().decode() if proc.stdout else ""
    proc.wait(timeout=60)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("progress") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(300)))
    return path


def _preprocess(corpus: Path, prefix: str, *extra: str) -> list[str]:
    tool = "tools/datasets/preprocess_data.py"
    args = ["--input", str(corpus), "--output-prefix", str(corpus.parent / prefix), "--tokenizer-type"]
    return [PYTHON, tool, *args, "CharLevelTokenizer", "--append-eod", "--num-docs", "300", *extra]


def test_progress_bar_on_terminal_stderr_only(corpus: Path) -> None:
    rc, out, err = _run(_preprocess(corpus, "tty"), stderr_tty=True)
    assert rc == 0, out + err
    assert re.search(r"tokenizing: +\d+%\|.*\| \d+/300 ", err), err  # tqdm's bar with the --num-docs total
    assert "tokenizing" not in out and "Processed 300 documents" in out


def test_no_progress_bar_when_stderr_is_not_a_terminal(corpus: Path) -> None:
    rc, out, err = _run(_preprocess(corpus, "pipe"), stderr_tty=False)
    assert rc == 0, out + err
    assert "tokenizing" not in err and "\r" not in err
    assert err.strip().splitlines()[-1].startswith("300/300 docs |")  # the one final rates line stays
    assert "Processed 300 documents" in out


def test_quiet_turns_the_bar_off_on_a_terminal(corpus: Path) -> None:
    rc, out, err = _run(_preprocess(corpus, "quiet", "--quiet"), stderr_tty=True)
    assert rc == 0, out + err
    assert "tokenizing" not in err
    assert "Processed 300 documents" in out


def test_bars_enabled_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("RANK", raising=False)
    assert progress_mod.bars_enabled(Tty()) and not progress_mod.bars_enabled(io.StringIO())
    monkeypatch.setenv("RANK", "1")
    assert not progress_mod.bars_enabled(Tty())  # only rank 0 draws on a shared terminal
    monkeypatch.setenv("RANK", "0")
    progress_mod.set_quiet(True)
    try:
        assert not progress_mod.bars_enabled(Tty())
    finally:
        progress_mod.set_quiet(False)
    stream = Tty()
    with progress_mod.progress(desc="unit", total=3, stream=stream) as bar:
        bar.update(3)
    assert "unit:   0%|" in stream.getvalue() and "0/3" in stream.getvalue()
