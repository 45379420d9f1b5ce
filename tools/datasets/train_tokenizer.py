"""Train a tokenizers JSON on JSONL documents; see ``megatron/tokenizer/train_tokenizer.py`` for the flags."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.tokenizer.train_tokenizer import cli, main, parse_args  # noqa: F401 - GPT-NeoX's module API

if __name__ == "__main__":
    raise SystemExit(cli())
