"""Evaluation extras of the training loop: ``eval_tasks`` through lm-eval and ``char_level_ppl``.

* :func:`build_task_eval` returns a callable the loop runs at every validation (``eval_interval`` and the end of
  training): the tasks are scored on the model being trained (the vocabulary-parallel logits are gathered over TP,
  requests split over DP; with ``pipe_parallel_size >= 2`` every stage runs its layers of the ``PipelineModule``
  outside the engine's train schedule and the last stage's logits are broadcast to every stage, see
  :mod:`megatron.evaluation.pipe_stage`) and come back, the same on every rank, as ``{"<task>_<metric>": value}``,
  which the loop logs as ``validation/<task>_<metric>`` (GPT-NeoX's names). Python / NumPy / torch RNG states are restored
  afterwards, so evaluating does not change the training run.
* :class:`CharCounter` wraps a validation iterator and counts tokens and detokenised characters of the batches it
  yields; ``validation/lm_loss_char_lvl_ppl = exp(lm_loss * tokens / chars)`` (GPT-NeoX's formula).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from megatron import mpu
from megatron.engine_protocol import Engine
from megatron.evaluation.config import EvalConfig
from megatron.evaluation.pipe_stage import TrainingPipeStage
from megatron.evaluation.tasks import resolve_tasks
from megatron.generation.parallel import StageForward
from megatron.mpu.dp_split import DataParallelSplit


def build_task_eval(engine: Engine, tokenizer: Any, cfg: EvalConfig) -> Callable[[], dict[str, float]] | None:
    """The ``eval_tasks`` callable for the loop, or None when no tasks are configured (tasks resolved now)."""
    if not cfg.eval_tasks:
        return None
    pp = cfg.pipe_parallel_size
    resolve_tasks(cfg.eval_tasks)  # a bad task name fails before training starts
    module = engine.module
    stages = None
    if pp > 1:
        stages = StageForward(TrainingPipeStage(module))

    def logits(tokens: torch.Tensor, cache: Any = None) -> torch.Tensor:
        if pp == 1:  # a one-stage PipelineModule runs every spec on this rank
            b, s = tokens.shape
            positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
            out = module((tokens, positions, None))
        else:
            out = module(tokens, kv_cache=cache)
        if mpu.model_parallel_is_initialized() and mpu.get_model_parallel_world_size() > 1:
            out = mpu.gather_from_model_parallel_region(out.contiguous())
        return out

    def forward(tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        return logits(tokens, cache)

    def run() -> dict[str, float]:
        # lm_eval (a heavy optional dependency) is imported only by runs that evaluate tasks
        from megatron.evaluation.adapter import NeoXEvalAdapter
        from megatron.evaluation.runner import flatten_metrics, run_eval_harness

        group = mpu.get_data_parallel_group() if mpu.model_parallel_is_initialized() else None
        adapter = NeoXEvalAdapter(
            tokenizer=tokenizer,
            score_fn=stages.score if stages is not None else logits,
            forward=stages if stages is not None else forward,
            max_length=cfg.max_length,
            micro_batch_size=cfg.micro_batch_size,
            vocab_size=tokenizer.vocab_size,
            device=next(module.parameters()).device,
            dp=DataParallelSplit(group),
            seed=cfg.seed,
            recompute=pp >= 1,
        )
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                return flatten_metrics(run_eval_harness(adapter, cfg))
        finally:
            module.train(was_training)
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])

    return run


class CharCounter:
    """Iterator wrapper counting tokens and characters (detokenised) of the ``text`` of each batch it yields."""

    def __init__(self, data_iter: Iterator[Any] | None, tokenizer: Any) -> None:
        self.data_iter, self.tokenizer = data_iter, tokenizer
        self.tokens = 0
        self.chars = 0

    def __iter__(self) -> CharCounter:
        return self

    def __next__(self) -> Any:
        if self.data_iter is None:
            raise StopIteration
        batch = next(self.data_iter)
        for row in batch["text"]:
            ids = row.tolist()
            self.tokens += len(ids)
            self.chars += len(self.tokenizer.detokenize(ids))
        return batch

    def tokens_per_char(self) -> float:
        """Tokens / characters over every rank's batches (ranks without data add nothing)."""
        counts = torch.tensor([self.tokens, self.chars], dtype=torch.float64)
        mpu.all_reduce_sum(counts)
        return float(counts[0] / counts[1]) if counts[1] > 0 else float("nan")


def char_counter_factory(tokenizer: Any, char_level_ppl: bool) -> Callable[[Iterator[Any] | None], CharCounter] | None:
    """``CharCounter`` builder for the loop when ``char_level_ppl`` is set, else None."""
    if not char_level_ppl:
        return None
    return lambda data_iter: CharCounter(data_iter, tokenizer)
