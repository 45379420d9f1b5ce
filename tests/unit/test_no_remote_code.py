"""Every ``from_pretrained`` call of the project passes ``trust_remote_code=False``: a Hugging Face folder's own Python
(``auto_map``) must never run, not even after transformers' "run the custom code? [y/N]" prompt."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("megatron", "tools", "benchmarks", "scripts")


def _python_files() -> list[Path]:
    files = sorted(ROOT.glob("*.py"))
    for folder in SCANNED:
        # hidden folders are not the project's code (benchmarks/peers/.venv-*: the peer frameworks' virtualenvs)
        files += sorted(
            p
            for p in (ROOT / folder).rglob("*.py")
            if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
        )
    return files


def _untrusting(call: ast.Call) -> bool:
    return any(
        kw.arg == "trust_remote_code" and isinstance(kw.value, ast.Constant) and kw.value.value is False
        for kw in call.keywords
    )


def calls_lacking_the_flag(path: Path) -> list[str]:
    """``file:line`` of each ``*.from_pretrained(...)`` call in ``path`` without ``trust_remote_code=False``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "from_pretrained" and not _untrusting(node):
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            bad.append(f"{where}:{node.lineno}")
    return bad


def test_every_from_pretrained_call_refuses_remote_code() -> None:
    files = _python_files()
    assert any(p.name == "hf_io.py" for p in files) and any(p.name == "deepy.py" for p in files)
    bad = [where for path in files for where in calls_lacking_the_flag(path)]
    assert not bad, "from_pretrained without trust_remote_code=False at: " + ", ".join(bad)


def test_the_walk_finds_a_call_lacking_the_flag(tmp_path: Path) -> None:
    """The checker itself: a call without the flag (or with ``True``) is reported with its line."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from transformers import AutoConfig\n"
        "AutoConfig.from_pretrained('x', trust_remote_code=False)\n"
        "AutoConfig.from_pretrained('x')\n"
        "AutoConfig.from_pretrained('x', trust_remote_code=True)\n"
    )
    assert calls_lacking_the_flag(sample) == ["sample.py:3", "sample.py:4"]
