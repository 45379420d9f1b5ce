"""Training runs with ``curriculum_learning`` on (for tests/e2e/test_curriculum.py): the sequence length every
training step's model forward saw (tokens, position ids, attention mask), and what ``on_step`` reported."""

from __future__ import annotations

from typing import Any

import torch


def curriculum_run(config: dict[str, Any]) -> dict[str, Any]:
    """Run ``config`` on this rank; per training iteration: the shapes the model's input had in that iteration's
    forwards, and the ``seq_length`` its ``StepResult`` carried."""
    from megatron.model.gpt2_model import GPTSequential
    from megatron.model.word_embeddings import EmbeddingPipe
    from tests.distributed.fns_train import run_pretrain

    seen: list[tuple[int, ...]] = []
    evaluated: list[tuple[int, ...]] = []  # evaluation forwards' input shapes
    per_step: list[dict[str, Any]] = []

    def model_input(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
        # the whole model (pp=0) or the pipeline's first stage: ((tokens, position ids, attention mask),); the
        # whole model passes its first layer no mask when it is the plain causal one of the tokens' length
        if isinstance(module, GPTSequential | EmbeddingPipe) and isinstance(inputs[0], tuple):
            tokens, position_ids, mask = inputs[0]
            if mask is not None:
                shape = (int(tokens.size(1)), int(position_ids.size(1)), *map(int, mask.shape[-2:]))
                (seen if module.training else evaluated).append(shape)

    def on_step(iteration: int, result: Any) -> None:
        per_step.append({"iteration": iteration, "reported": result.seq_length, "seen": sorted(set(seen))})
        seen.clear()

    hook = torch.nn.modules.module.register_module_forward_pre_hook(model_input)
    try:
        result = run_pretrain(config, on_step=on_step)
    finally:
        hook.remove()
    steps, losses, start = per_step, result["train_losses"], result["start_iteration"]
    return {"steps": steps, "losses": losses, "start": start, "evaluated": sorted(set(evaluated))}


def curriculum_runs(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`curriculum_run` of each config, one after the other on the same ranks."""
    return [curriculum_run(config) for config in configs]
