"""Generation and evaluation under training layouts on gloo ranks (for tests/distributed/test_inference_layouts.py).

One spawned world runs every layout in turn (the model-parallel groups are rebuilt between layouts); rank 0
returns what it generated / scored per layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def recording_stages() -> Iterator[list[Any]]:
    """The ``InferenceStage`` each ``setup_stage_for_inference`` call builds (proof of the training-layout path)."""
    import megatron.generation.parallel as parallel

    built: list[Any] = []
    setup = parallel.setup_stage_for_inference

    def recording_setup(args: Any) -> Any:
        stage, tokenizer = setup(args)
        built.append(stage)
        return stage, tokenizer

    parallel.setup_stage_for_inference = recording_setup
    try:
        yield built
    finally:
        parallel.setup_stage_for_inference = setup


def generate_layouts(configs: list[str], overrides: dict[str, Any], layouts: list[tuple[int, int, str]]) -> dict:
    """``{"tp<t>_pp<p>_<precision>": {records, stage, tp_rank, dtypes}}`` of ``run_generation`` under each
    ``(model_parallel_size, pipe_parallel_size, precision)``."""
    from megatron import mpu
    from megatron.generation.text_generation import run_generation
    from megatron.neox_arguments import NeoXArgs

    out: dict[str, Any] = {}
    with recording_stages() as built:
        for tp, pp, precision in layouts:
            mpu.destroy_model_parallel()
            values = {**overrides, "model_parallel_size": tp, "pipe_parallel_size": pp, "precision": precision}
            records = run_generation(NeoXArgs.from_ymls(configs, overwrite_values=values))
            out[f"tp{tp}_pp{pp}_{precision}"] = {
                "records": records,
                "stage": mpu.get_pipe_parallel_rank(),
                "tp_rank": mpu.get_model_parallel_rank(),
                "dtypes": sorted({str(p.dtype) for p in built[-1].parameters()}),
            }
    return out


def evaluate_layouts(configs: list[str], overrides: dict[str, Any], layouts: list[tuple[int, int]], cwd: str) -> dict:
    """``{"tp<t>_pp<p>": metrics}`` of eval.py's ``evaluate_checkpoint`` under each layout (rank 0's result file is
    written under ``cwd``; the path is returned too)."""
    import os

    from megatron import mpu
    from megatron.evaluation.standalone import evaluate_checkpoint
    from megatron.neox_arguments import NeoXArgs

    os.chdir(cwd)
    out: dict[str, Any] = {}
    for tp, pp in layouts:
        mpu.destroy_model_parallel()
        values = {**overrides, "model_parallel_size": tp, "pipe_parallel_size": pp}
        path, metrics = evaluate_checkpoint(NeoXArgs.from_ymls(configs, overwrite_values=values))
        out[f"tp{tp}_pp{pp}"] = {"path": path, "metrics": metrics, "dp": mpu.get_data_parallel_world_size()}
    return out


def precompute_layouts(configs: list[str], overrides: dict[str, Any], layouts: list[tuple[int, int]]) -> dict:
    """``{"tp<t>_pp<p>": {records, stage, tp_rank}}`` of ``text_gen_type: precompute`` under each layout (the
    output named after it)."""
    from megatron import mpu
    from megatron.generation.text_generation import run_generation
    from megatron.neox_arguments import NeoXArgs

    out: dict[str, Any] = {}
    with recording_stages() as built:
        for tp, pp in layouts:
            mpu.destroy_model_parallel()
            name, count = f"tp{tp}_pp{pp}", len(built)
            values = {**overrides, "model_parallel_size": tp, "pipe_parallel_size": pp, "precompute_model_name": name}
            records = run_generation(NeoXArgs.from_ymls(configs, overwrite_values=values))
            parallel = len(built) > count  # False: not run under the training layout
            out[name] = {
                "records": records,
                "stage": built[-1].stage if parallel else None,
                "tp_rank": mpu.get_model_parallel_rank() if parallel else None,
            }
    return out


def run_all(configs: list[str], gen: dict[str, Any], gen_layouts: list, evl: dict[str, Any], eval_layouts: list,
            cwd: str, pre: dict[str, Any] | None = None, pre_layouts: list = ()) -> dict:  # fmt: skip
    """The above in one world (one spawn of the ranks); lm-eval's dataset cache under ``cwd``."""
    import os

    os.environ["HF_HOME"] = os.path.join(cwd, "hf_home")
    return {
        "generate": generate_layouts(configs, gen, gen_layouts),
        "eval": evaluate_layouts(configs, evl, eval_layouts, cwd),
        "precompute": precompute_layouts(configs, pre or {}, pre_layouts),
    }
