"""The prompts of ``generate.py``: ``sample_input_file`` and interactive input, read without torch (``generate.py``
refuses a missing or undecodable prompt file before it imports torch and loads the model)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

from megatron.neox_arguments.errors import ConfigError


def read_prompts(path: str, prompt_end: str = "\n") -> list[str]:
    """GPT-NeoX's prompts of ``sample_input_file``: split on ``prompt_end``, each stripped, empty ones dropped.

    The file is read with universal newlines, so ``\r\n`` line ends count as ``\n``.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"sample_input_file {path} does not exist")
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"sample_input_file {path}:{line}: invalid UTF-8 (byte {e.start}); prompts must be UTF-8 text"
        ) from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as read_text gives
    prompts = [p.strip() for p in text.split(prompt_end)]
    return [p for p in prompts if p]


def read_interactive_prompt(stream: TextIO, prompt_end: str = "\n") -> str | None:
    """One prompt from ``stream``: a line when ``prompt_end`` is a newline, else lines up to the first
    ``prompt_end`` (newlines kept); None at end of input."""
    text = ""
    for line in stream:
        line = line.rstrip("\r\n") if line.endswith("\n") else line
        if prompt_end in ("\n", "\r\n"):
            return line
        if prompt_end in line:
            return text + line.split(prompt_end)[0]
        text += line + "\n"
    return text or None
