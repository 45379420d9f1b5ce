"""Evaluate a trained checkpoint on lm-evaluation-harness tasks (GPT-NeoX's ``eval.py``).

    python deepy.py eval.py configs/cpu/quickstart.yml --eval_tasks configs/eval/ lambada_openai

``eval_tasks`` entries are lm-eval task names, glob patterns, or local task YAML files / folders. Rank 0 writes
``[<eval_results_prefix>_]eval_results_<date>.json`` (results, config, git hash) and logs ``eval/<task>_<metric>``
to TensorBoard / W&B; with several ranks the requests are split data-parallel.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)


def main(input_args: list[str] | None = None, overwrite_values: dict[str, Any] | None = None) -> int:
    """Parse the worker arguments, load the checkpoint, evaluate; returns the exit code.

    GPT-NeoX's signature: called with arguments (``get_deepspeed_main_args()``'s list, key overrides) it runs in
    this process and raises on errors; as a script it prints them in one line and ends the rank."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    for noisy in ("lm_eval", "lm-eval", "datasets", "DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from megatron.distributed import shutdown_and_exit
    from megatron.evaluation.standalone import evaluate_checkpoint
    from megatron.neox_arguments import NeoXArgs

    in_process = input_args is not None or overwrite_values is not None
    code = 0
    try:
        args = NeoXArgs.consume_neox_args(overwrite_values=overwrite_values, input_args=input_args)
        path, metrics = evaluate_checkpoint(args)
        if path:
            print(json.dumps(metrics, indent=2, sort_keys=True), flush=True)
            print(f"wrote {path}", flush=True)
    except ValueError as e:  # configuration, task or checkpoint mistakes
        if in_process:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 1
    except Exception:
        if in_process:
            raise
        logging.getLogger("megatron.eval").exception("evaluation failed")
        code = 1
    if not in_process:
        shutdown_and_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
