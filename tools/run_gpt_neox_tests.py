#!/usr/bin/env python
"""Run GPT-NeoX's own test suite against neox-forge, on CPU.

    python tools/run_gpt_neox_tests.py /path/to/gpt-neox [--data-dir data] [-- tests/neox_args -k consume]

Copies neox-forge's tracked files into a temporary folder, replaces its ``tests/`` and ``configs/`` with the
GPT-NeoX checkout's (the tests load configs by name from there), links ``--data-dir`` as ``data/`` when given (GPT-NeoX's
tests read ``data/gpt2-vocab.json``, ``data/enwik8/...``), runs pytest there with ``DS_ACCELERATOR=cpu`` and no
network, and prints the passed / failed / error / skipped counts and the failures' one-line reasons.

A developer's tool, run by hand: CI does not run GPT-NeoX's code. Extra arguments after ``--`` go to pytest
(a subfolder or ``-k``: the whole suite is slow on a small machine).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)

REPO = Path(__file__).resolve().parent.parent
OUTCOMES = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")


def copy_project(dest: Path) -> None:
    """neox-forge's tracked (and untracked, not ignored) files, without its tests and configs."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if rel.split("/", 1)[0] in ("tests", "configs") or not (REPO / rel).is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)


def prepare(neox: Path, dest: Path, data_dir: Path | None) -> None:
    """The combined tree: ours, with GPT-NeoX's tests/ and configs/ (and a data/ link)."""
    for sub in ("tests", "configs"):
        if not (neox / sub).is_dir():
            raise ValueError(f"{neox} has no {sub}/ folder: is it a GPT-NeoX checkout?")
    copy_project(dest)
    shutil.copytree(neox / "tests", dest / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(neox / "configs", dest / "configs")
    if data_dir is not None:
        os.symlink(data_dir.resolve(), dest / "data")


# ``--unskip``: a pytest plugin written into the combined tree that drops GPT-NeoX's skip/xfail marks, to see how
# far its model tests get (most are marked skip there: "until we fix the CUDA + torch multiprocessing issue").
UNSKIP_PLUGIN = """
def pytest_collection_modifyitems(items):
    for item in items:
        for node in item.listchain():
            node.own_markers[:] = [m for m in node.own_markers if m.name not in ("skip", "xfail")]
"""


def counts(output: str) -> dict[str, int]:
    """The outcome counts of pytest's final summary line (``3 passed, 1 failed, 2 skipped in 4.2s``)."""
    summary = next((ln for ln in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed|error)", ln)), "")
    found = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", summary)}
    if "error" in found:
        found["errors"] = found.pop("error")
    return {k: found.get(k, 0) for k in OUTCOMES}


# GPT-NeoX tests that contact hosts on the internet (HEAD requests to the dataset URLs): left out unless asked for.
NETWORK_TESTS = ("tests/unit/test_url_accessibility.py",)


def run(
    neox: Path, data_dir: Path | None, pytest_args: list[str], keep: bool, network: bool = False, unskip: bool = False
) -> int:
    work = Path(tempfile.mkdtemp(prefix="gpt-neox-tests-"))
    try:
        prepare(neox, work, data_dir)
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "CUDA_VISIBLE_DEVICES": "",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "WANDB_MODE": "offline",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(work),
        }
        # GPT-NeoX's pytest.ini (its `cpu` marker), not our pyproject's settings
        cmd = [sys.executable, "-m", "pytest", "-c", "tests/pytest.ini", "--rootdir", str(work)]
        cmd += ["-p", "no:cacheprovider", "-q", "-rfE", "--no-header"]
        cmd += ["--continue-on-collection-errors", *([] if network else [f"--ignore={t}" for t in NETWORK_TESTS])]
        if unskip:
            (work / "_neox_forge_unskip.py").write_text(UNSKIP_PLUGIN)
            cmd += ["-p", "_neox_forge_unskip"]
        cmd += pytest_args or ["tests"]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        reasons = [ln for ln in output.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
        print("\n".join(reasons))
        found = counts(output)
        print(" | ".join(f"{k}: {v}" for k, v in found.items()) + f" | total: {sum(found.values())}")
        if not any(found.values()):
            print(output[-3000:])
        return proc.returncode
    finally:
        if keep:
            print(f"kept the combined tree at {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns pytest's exit status (2 for a bad checkout path)."""
    argv = sys.argv[1:] if argv is None else argv
    pytest_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("neox", type=Path, help="a GPT-NeoX checkout (its tests/ and configs/ are used)")
    p.add_argument("--data-dir", type=Path, default=None, help="linked as data/ (gpt2-vocab.json, enwik8/, ...)")
    p.add_argument("--keep", action="store_true", help="keep the temporary combined tree")
    p.add_argument("--network", action="store_true", help="also run the tests that contact the dataset hosts")
    p.add_argument("--unskip", action="store_true", help="drop GPT-NeoX's skip/xfail marks (its model tests)")
    args = p.parse_args(argv)
    try:
        return run(args.neox, args.data_dir, pytest_args, args.keep, args.network, args.unskip)
    except (ValueError, OSError, subprocess.CalledProcessError) as e:
        print(f"run_gpt_neox_tests.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
