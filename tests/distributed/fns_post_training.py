"""Post-training runs on gloo ranks (for tests/e2e/test_post_training.py): pretrain() plus what the test inspects.

The per-iteration objective metrics (``StepResult.extra``) and the first SFT loss inputs are recorded by wrapping
the real functions (each wrapper calls through), so the tests see what the training path computed.
"""

from __future__ import annotations

from typing import Any

from tests.distributed.fns_train import run_pretrain


def run_recorded(config: dict[str, Any]) -> dict[str, Any]:
    """``run_pretrain`` + ``metrics`` (one dict per iteration) + ``sft_batch`` (targets/mask of the first SFT loss)."""
    import megatron.model
    from megatron.training.post_training_step import PostTrainStep

    metrics: list[dict[str, float]] = []
    first_batch: dict[str, list] = {}
    train, ce = PostTrainStep.train, megatron.model.cross_entropy

    def recording_train(self: PostTrainStep, data_iter: Any) -> Any:
        result = train(self, data_iter)
        metrics.append(dict(result.extra))
        return result

    def recording_ce(output: Any, labels: Any, *a: Any) -> Any:
        if not first_batch:
            first_batch.update(targets=labels[0].tolist(), mask=labels[1].tolist())
        return ce(output, labels, *a)

    PostTrainStep.train, megatron.model.cross_entropy = recording_train, recording_ce
    try:
        out = run_pretrain(config)
    finally:
        PostTrainStep.train, megatron.model.cross_entropy = train, ce
    return {**out, "metrics": metrics, "sft_batch": first_batch}


def run_recorded_many(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several recorded runs one after the other on the same ranks."""
    return [run_recorded(c) for c in configs]


def run_precompute_then_train(
    sft: dict[str, Any], precompute: list[dict[str, Any]], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """Train and save ``sft``; write reference log-probs with each ``precompute`` config (``text_gen_type:
    precompute``, the real ``generate.py`` path); then the recorded ``runs``. Returns the outputs and the runs."""
    from megatron.generation.text_generation import run_generation
    from megatron.neox_arguments import NeoXArgs

    run_recorded(sft)
    written = [run_generation(NeoXArgs.from_dict(c)) for c in precompute]
    return {"precomputed": written, "runs": [run_recorded(c) for c in runs]}
