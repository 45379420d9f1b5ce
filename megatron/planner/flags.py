"""The valid range of every numeric ``deepy.py --plan`` flag, checked before anything is planned.

argparse hands the numbers over as text; :func:`check_flags` converts each one and raises one ConfigError listing
every flag outside its range (``--gpus 0: must be an integer between 1 and 1048576``). Integers must be written
as integers (``1e9`` is refused), floats must be finite. The bounds keep every estimate finite: the smallest
bandwidth or peak still gives step times far below float overflow, the largest GPU count still enumerates quickly.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass

from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.ranges import Range

MAX_GPUS = 2**20
MAX_VOCAB = 2**31 - 1  # token ids are int32 in GPT-NeoX's datasets
_INT_RE = re.compile(r"\s*[+-]?[0-9]{1,20}\s*")  # no digit strings long enough to be slow to convert


@dataclass(frozen=True)
class Flag:
    """One numeric flag: its range and whether it must be a whole number."""

    name: str
    valid: Range
    integer: bool

    @property
    def dest(self) -> str:
        """The argparse attribute name."""
        return self.name.removeprefix("--").replace("-", "_")

    def describe(self) -> str:
        """``an integer between 1 and 8`` / ``a finite number in (0, 1]``."""
        return f"{'an integer' if self.integer else 'a finite number'} {self.valid.describe()}"

    def parse(self, text: str) -> int | float | str:
        """The number ``text`` holds, or the problem line naming the flag."""
        problem = f"{self.name} {text!r}: must be {self.describe()}"
        if self.integer:
            if not _INT_RE.fullmatch(text):
                return problem
            value: int | float = int(text)
        else:
            try:
                value = float(text)
            except ValueError:
                return problem
        return value if self.valid.contains(float(value)) else problem


FLAGS: tuple[Flag, ...] = (
    Flag("--gpus", Range(1, MAX_GPUS), integer=True),
    Flag("--gpus-per-node", Range(1, 1024), integer=True),
    Flag("--peak-tflops", Range(0.001, 10**6), integer=False),
    Flag("--intra-node-GBps", Range(0.001, 10**6), integer=False),
    Flag("--inter-node-GBps", Range(0.001, 10**6), integer=False),
    Flag("--hbm-GBps", Range(0.001, 10**6), integer=False),
    Flag("--top", Range(1, 10**6), integer=True),
    Flag("--memory-headroom", Range(0, 1, hi_open=True), integer=False),
    Flag("--search-seconds", Range(0.01, 86400), integer=False),
    Flag("--vocab-size", Range(1, MAX_VOCAB), integer=True),
    Flag("--kv-batch", Range(1, 2**20), integer=True),
    Flag("--kv-tokens", Range(1, 2**24), integer=True),
)


def add_flags(parser: argparse.ArgumentParser, defaults: dict[str, float | None], helps: dict[str, str]) -> None:
    """Add every numeric flag as text (``check_flags`` converts it); ``helps`` holds each flag's help."""
    for flag in FLAGS:
        default = defaults.get(flag.name)
        parser.add_argument(flag.name, default=None if default is None else str(default), help=helps[flag.name])


def check_flags(ns: argparse.Namespace, flags: Sequence[Flag] = FLAGS) -> None:
    """Replace each given flag's text by its number in ``ns``; one ConfigError with every flag out of range."""
    problems = []
    for flag in flags:
        text = getattr(ns, flag.dest)
        if text is None:
            continue
        value = flag.parse(str(text))
        if isinstance(value, str):
            problems.append(value)
        else:
            setattr(ns, flag.dest, value)
    if problems:
        raise ConfigError(problems)


def check_gpus(gpus: int, where: str) -> int:
    """The GPU count taken from the config when ``--gpus`` is not given must be in ``--gpus``'s range too."""
    gpus_flag = FLAGS[0]
    if not gpus_flag.valid.contains(float(gpus)):
        raise ConfigError(f"{where} gives {gpus} GPUs: --gpus must be {gpus_flag.describe()}")
    return gpus
