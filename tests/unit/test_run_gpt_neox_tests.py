"""tools/run_gpt_neox_tests.py on a stand-in checkout (our own three-test suite, not GPT-NeoX's code): the combined
tree has our package and the checkout's tests/configs, and the counts are read from pytest's summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import load_tool

tool = load_tool("tools/run_gpt_neox_tests.py")


def _checkout(root: Path) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "configs" / "tiny.yml").write_text("{}\n")
    (root / "tests" / "pytest.ini").write_text("[pytest]\nmarkers =\n    cpu: cpu tests\n")
    (root / "tests" / "test_stand_in.py").write_text(
        "import pytest\n"
        "from pathlib import Path\n\n"
        "@pytest.mark.cpu\n"
        "def test_our_api_is_importable():\n"
        "    from megatron.neox_arguments import NeoXArgs\n"
        "    assert hasattr(NeoXArgs, 'get_deepspeed_main_args') and Path('configs/tiny.yml').is_file()\n\n"
        "def test_fails():\n    assert False\n\n"
        "@pytest.mark.skip(reason='marked')\n"
        "def test_skipped():\n    pass\n"
    )
    return root


@pytest.mark.launches  # the tool runs pytest in a Python subprocess
def test_counts_and_unskip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    neox = _checkout(tmp_path / "neox")
    assert tool.main([str(neox)]) == 1  # one test fails
    out = capsys.readouterr().out
    assert "FAILED tests/test_stand_in.py::test_fails" in out
    assert "passed: 1 | failed: 1 | errors: 0 | skipped: 1" in out
    tool.main([str(neox), "--unskip", "--", "tests/test_stand_in.py", "-k", "skipped"])
    assert "passed: 1 | failed: 0 | errors: 0 | skipped: 0" in capsys.readouterr().out


def test_not_a_checkout_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert tool.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no tests/ folder" in err and len(err.strip().splitlines()) == 1


def test_counts_parser() -> None:
    line = "==== 3 passed, 1 failed, 2 errors, 5 skipped, 1 xfailed in 4.20s ===="
    assert tool.counts(f"noise\n{line}\n") == {
        "passed": 3, "failed": 1, "errors": 2, "skipped": 5, "xfailed": 1, "xpassed": 0
    }  # fmt: skip
