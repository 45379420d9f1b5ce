"""``eval.py``'s work: load a checkpoint on every rank, evaluate data-parallel, write GPT-NeoX's results file."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from megatron import mpu
from megatron.cluster.worker_env import launched_world_size
from megatron.distributed import init_distributed
from megatron.evaluation.adapter import DataParallelSplit
from megatron.evaluation.config import EvalConfig
from megatron.evaluation.runner import (
    GPT_NEOX_DEFAULT_TASKS,
    build_adapter,
    flatten_metrics,
    results_path,
    run_eval_harness,
    write_results,
)
from megatron.evaluation.tasks import resolve_tasks
from megatron.generation.config import InferenceConfig
from megatron.generation.parallel import StageForward, runs_model_parallel, setup_stage_for_inference
from megatron.generation.text_generation import setup_for_inference
from megatron.logging.comet import check_comet
from megatron.logging.metrics import LoggingConfig, Metrics

if TYPE_CHECKING:
    from megatron.neox_arguments import NeoXArgs

logger = logging.getLogger(__name__)


def evaluate_checkpoint(args: NeoXArgs) -> tuple[str | None, dict[str, float]]:
    """``eval.py``'s work (entry level: reads the module configs from the arguments once, see :func:`evaluate`)."""
    return evaluate(
        EvalConfig.from_neox_args(args),
        InferenceConfig.from_neox_args(args),
        LoggingConfig.from_neox_args(args),
        run_config=args.to_dict(),
        results_prefix=args.eval_results_prefix,
    )


def evaluate(
    cfg: EvalConfig,
    inference: InferenceConfig,
    log_cfg: LoggingConfig,
    *,
    run_config: dict[str, Any],
    results_prefix: str = "",
) -> tuple[str | None, dict[str, float]]:
    """Evaluate ``load`` on ``eval_tasks``; returns ``(results file, metrics)`` (``(None, metrics)`` off rank 0).

    With ``model_parallel_size`` / ``pipe_parallel_size`` and several ranks each rank runs its part of the model
    (training layout; the last stage's logits are shared with every stage) and the data-parallel replicas split
    every request batch; otherwise each rank loads the whole model (any TP/PP layout merged on read) and scores its
    share. Rank 0 writes the results (with ``run_config``, the resolved keys) and the ``eval/<task>_<metric>``
    scalars.
    """
    check_comet(log_cfg.use_comet)  # on every rank, before the checkpoint is read (only rank 0 logs the scalars)
    world = launched_world_size()
    if not cfg.eval_tasks:
        logger.info("eval_tasks unset: GPT-NeoX's default tasks %s", " ".join(GPT_NEOX_DEFAULT_TASKS))
        cfg.eval_tasks = list(GPT_NEOX_DEFAULT_TASKS)
    resolve_tasks(cfg.eval_tasks)  # checked before the checkpoint is read (the task index is built once)
    if runs_model_parallel(inference.model_parallel_size, inference.pipe_parallel_size):
        stage, tokenizer = setup_stage_for_inference(inference)
        forward = StageForward(stage)
        dp = DataParallelSplit(mpu.get_data_parallel_group())
        adapter = build_adapter(forward.score, tokenizer, cfg, dp, forward=forward)
    else:
        if world > 1:
            init_distributed()
        model, tokenizer = setup_for_inference(inference)
        adapter = build_adapter(model, tokenizer, cfg, DataParallelSplit())
    results = run_eval_harness(adapter, cfg)
    metrics = flatten_metrics(results)
    rank = mpu.world_rank()
    if rank != 0:
        return None, metrics
    path = results_path(results_prefix)
    write_results(
        results,
        run_config,
        path,
        batch_size=adapter.batch_size,
        device=str(adapter.device),
        limit=cfg.eval_limit,
        bootstrap_iters=cfg.eval_bootstrap_iters,
    )
    sink = Metrics.create(log_cfg, rank=rank, run_config=run_config)
    sink.log({f"eval/{k}": v for k, v in metrics.items()}, step=int(inference.iteration or 0))
    sink.close()
    logger.info("wrote evaluation results to %s", path)
    return path, metrics
