"""What the repository holds: no large committed files, no paths of one developer's machine in code."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 500 * 1024
# An absolute path into a home, /work or /root folder is one machine's layout: code finds what it needs from its own
# location, a flag or an environment variable (the shared reference files: NEOX_FORGE_SHARED or ../shared).
MACHINE_PATH = re.compile(r"""["'](/work/|/root/|/home/[a-z])""")
CODE_SUFFIXES = (".py", ".sh", ".yml", ".yaml", ".toml", ".cfg")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_committed_file_is_over_500_kb() -> None:
    sizes = {p: p.stat().st_size for p in _tracked() if p.is_file()}
    big = [f"{p.relative_to(ROOT)} ({size // 1024} KB)" for p, size in sizes.items() if size > MAX_BYTES]
    assert not big, f"files over {MAX_BYTES // 1024} KB are committed (keep data out of git, build it in tests): {big}"


def test_no_machine_paths_in_code() -> None:
    hits = []
    for path in _tracked():
        if path.suffix not in CODE_SUFFIXES or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "absolute paths of one machine in code:\n" + "\n".join(hits)


def test_the_checks_catch_what_they_look_for() -> None:
    assert MACHINE_PATH.search('CORPUS = "/' + 'work/shared/data/x.txt"')  # split: this file is scanned too
    assert not MACHINE_PATH.search('path = "/tmp/kernels"')
