"""A one-line hint, not a traceback, when an entry point runs under a Python without neox-forge's packages.

Every entry point (``deepy.py``, ``train.py``, ``generate.py``, ``tools/...``) imports this module before anything
else; importing it checks the core runtime packages and, if any is missing, prints one line naming them and the
setup command to stderr and exits with status 1. ``require("matplotlib")`` checks a tool's extra packages the same
way. Only the standard library is used here, so the check itself runs under any Python 3.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# import name -> package name on PyPI (as in requirements/requirements.txt)
CORE = {
    "torch": "torch",
    "deepspeed": "deepspeed",
    "numpy": "numpy",
    "yaml": "pyyaml",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "tqdm": "tqdm",
    "psutil": "psutil",
}
EXTRAS = {"matplotlib": "matplotlib", "transformers": "transformers", "tensorboard": "tensorboard"}


def missing_packages(modules: list[str]) -> list[str]:
    """The PyPI names of the ``modules`` (import names) that this interpreter cannot import."""
    absent = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(CORE.get(module) or EXTRAS.get(module) or module)
    return absent


def setup_command() -> str:
    """The commands that install the environment and put it first on PATH, relative to the current folder."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rel = os.path.relpath(root)
    base = root if rel.startswith(os.pardir) else rel
    prefix = "" if base == os.curdir else base + os.sep
    return f"bash {prefix}scripts/bootstrap.sh && source {prefix}.venv/bin/activate"


def hint(absent: list[str], program: str | None = None) -> str:
    """The one line printed for ``absent`` packages."""
    prog = program or os.path.basename(sys.argv[0] or "") or "neox-forge"
    return (
        f"{prog}: error: this Python ({sys.executable}) lacks {', '.join(absent)}; "
        f"set up the environment with `{setup_command()}` and run the command again"
    )


def require(*modules: str) -> None:
    """Exit with status 1 and the hint unless the core packages and ``modules`` (import names) are importable."""
    absent = missing_packages([*CORE, *modules])
    if absent:
        sys.stderr.write(hint(absent) + "\n")
        sys.stderr.flush()
        raise SystemExit(1)


require()
