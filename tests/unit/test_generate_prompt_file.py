"""``generate.py`` refuses a missing or undecodable ``sample_input_file`` in one line before it imports torch and
loads the model (a fraction of a second, not the seconds of the imports and the checkpoint load)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.harness import PYTHON, REPO_ROOT, run_command


def _config(tmp_path: Path, prompt_file: Path) -> Path:
    cfg = yaml.safe_load((REPO_ROOT / "configs/cpu/tiny.yml").read_text())
    cfg.update(text_gen_type="input-file", sample_input_file=str(prompt_file), load=str(tmp_path / "checkpoints"))
    path = tmp_path / "gen.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("content", [None, b"ok\n\xff\xfe bad\n"], ids=["missing", "not_utf8"])
def test_generate_refuses_a_bad_prompt_file_before_importing_torch(tmp_path: Path, content: bytes | None) -> None:
    prompts = tmp_path / "prompts.txt"
    if content is not None:
        prompts.write_bytes(content)
    config = _config(tmp_path, prompts)
    script = (
        "import sys, runpy\n"
        f"sys.argv = ['generate.py', {str(config)!r}]\n"
        "try:\n"
        "    runpy.run_path('generate.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, 'torch imported:', 'torch' in sys.modules, flush=True)\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}  # as deepy starts CPU ranks
    result = run_command([PYTHON, "-c", script], timeout=120, check=False, cwd=str(REPO_ROOT), env=env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    expected = "does not exist" if content is None else "prompts.txt:2: invalid UTF-8"
    assert errors and f"sample_input_file {prompts}" in errors[0] and expected in errors[0], result.stderr
    assert "exit 1 torch imported: False" in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
