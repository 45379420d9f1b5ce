"""Generate text from a trained checkpoint (GPT-NeoX's ``generate.py``).

    python deepy.py generate.py configs/cpu/quickstart.yml --text_gen_type input-file --sample_input_file p.txt

Generates (greedy, or temperature / top-k / top-p sampling over the KV cache) through
``megatron.generation.api.generate_samples_from_prompt``; rank 0 writes GPT-NeoX's JSONL records
``{context, text, length, finished, message, duration_seconds}`` to ``sample_output_file``. With
``model_parallel_size`` / ``pipe_parallel_size`` and several ranks every rank runs its part of the model (training
layout); otherwise rank 0 generates alone (a TP/PP checkpoint merged) and the other ranks exit.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)


def main(input_args: list[str] | None = None, overwrite_values: dict[str, Any] | None = None) -> int:
    """Parse the worker arguments, generate, print the samples on rank 0; returns the exit code.

    GPT-NeoX's signature: called with arguments (``get_deepspeed_main_args()``'s list, key overrides) it runs in
    this process and raises on errors; as a script it prints them in one line and ends the rank."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    from megatron.cluster.worker_env import launched_world_size
    from megatron.neox_arguments import NeoXArgs

    in_process = input_args is not None or overwrite_values is not None
    try:
        args = NeoXArgs.consume_neox_args(overwrite_values=overwrite_values, input_args=input_args)
        check_prompt_file(args)  # torch and the model only for a readable prompt file
        from megatron.generation.text_generation import run_generation

        records = run_generation(args)
    except ValueError as e:  # configuration or checkpoint mistakes
        if in_process:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        if os.environ.get("WORLD_SIZE", "1") != "1":  # several ranks, or a bad WORLD_SIZE just reported: end the rank
            from megatron.distributed import shutdown_and_exit

            shutdown_and_exit(1)
        return 1
    for record in records:
        if "precomputed" in record:
            print(f"wrote {record['precomputed']}.bin/.idx", flush=True)
            continue
        note = f" [{record['message']}]" if record["message"] else ""
        print(f"----- prompt: {record['context']!r}{note}\n{record['context']}{record['text'] or ''}", flush=True)
    if launched_world_size() > 1 and not in_process:
        from megatron.distributed import shutdown_and_exit

        shutdown_and_exit(0)
    return 0


def check_prompt_file(args: Any) -> None:
    """Refuse a missing or undecodable ``sample_input_file`` before torch is imported, on the ranks that read it
    (rank 0, or every rank of a tensor/pipeline-parallel launch), with the error ``generate`` would give later."""
    from megatron.cluster.worker_env import launched_world_size
    from megatron.generation.prompts import read_prompts

    if args.text_gen_type != "input-file" or not args.sample_input_file:
        return
    parallel = launched_world_size() > 1 and args.model_parallel_size * max(args.pipe_parallel_size, 1) > 1
    if parallel or not args.rank:
        read_prompts(args.sample_input_file, args.prompt_end)


if __name__ == "__main__":
    sys.exit(main())
