"""Generate text from a trained checkpoint (GPT-NeoX's ``generate.py``).

    python deepy.py generate.py configs/cpu/quickstart.yml --text_gen_type input-file --sample_input_file p.txt

Rank 0 generates (greedy, or temperature / top-k / top-p sampling over the KV cache) and writes JSONL records
``{context, text, length, finished, message, duration_seconds}`` to ``sample_output_file``; other ranks exit.
"""

from __future__ import annotations

import logging
import os
import sys

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)


def main() -> int:
    """Parse the worker arguments, generate on rank 0, print the samples; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    from megatron.generation.text_generation import run_generation
    from megatron.neox_arguments import NeoXArgs

    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # generation is not parallelised: one rank does the work
    try:
        args = NeoXArgs.consume_neox_args()
        records = run_generation(args)
    except ValueError as e:  # configuration or checkpoint mistakes
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    for record in records:
        print(f"----- prompt: {record['context']!r}\n{record['context']}{record['text']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
