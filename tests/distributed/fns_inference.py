"""Generation and evaluation under training layouts on gloo ranks (for tests/distributed/test_inference_layouts.py).

One spawned world runs every layout in turn (the model-parallel groups are rebuilt between layouts); rank 0
returns what it generated / scored per layout.
"""

from __future__ import annotations

from typing import Any


def generate_layouts(configs: list[str], overrides: dict[str, Any], layouts: list[tuple[int, int, str]]) -> dict:
    """``{"tp<t>_pp<p>_<precision>": {records, stage, tp_rank, dtypes}}`` of ``run_generation`` under each
    ``(model_parallel_size, pipe_parallel_size, precision)``."""
    import megatron.generation.parallel as parallel
    from megatron import mpu
    from megatron.generation.text_generation import run_generation
    from megatron.neox_arguments import NeoXArgs

    out: dict[str, Any] = {}
    built: list[Any] = []
    setup = parallel.setup_stage_for_inference

    def recording_setup(args: Any) -> Any:
        stage, tokenizer = setup(args)
        built.append(stage)
        return stage, tokenizer

    parallel.setup_stage_for_inference = recording_setup
    try:
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
    finally:
        parallel.setup_stage_for_inference = setup
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


def run_all(configs: list[str], gen: dict[str, Any], gen_layouts: list, evl: dict[str, Any], eval_layouts: list,
            cwd: str) -> dict:  # fmt: skip
    """Both of the above in one world (one spawn of the ranks); lm-eval's dataset cache under ``cwd``."""
    import os

    os.environ["HF_HOME"] = os.path.join(cwd, "hf_home")
    return {
        "generate": generate_layouts(configs, gen, gen_layouts),
        "eval": evaluate_layouts(configs, evl, eval_layouts, cwd),
    }
