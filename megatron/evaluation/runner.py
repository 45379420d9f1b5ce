"""Run lm-eval tasks on a neox-forge model: standalone (``eval.py``) and during training (``eval_tasks``).

Metrics are flattened to ``<task>_<metric>`` (lm-eval's ``acc,none`` becomes ``acc``; another filter is appended,
``exact_match,strip`` → ``exact_match_strip``); ``eval.py`` logs them as ``eval/<name>`` and training as
``validation/<name>``. ``eval.py`` writes GPT-NeoX's ``[<eval_results_prefix>_]eval_results_<m-d-Y-H-M-S>.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from megatron.evaluation.adapter import DataParallelSplit, NeoXEvalAdapter
from megatron.evaluation.config import EvalConfig
from megatron.evaluation.tasks import resolve_tasks
from megatron.generation.loading import inference_device
from megatron.generation.sampling import kv_cache_forward

logger = logging.getLogger(__name__)

# What GPT-NeoX's eval.py evaluates when ``eval_tasks`` is unset (all of them download their datasets).
GPT_NEOX_DEFAULT_TASKS = ["lambada", "piqa", "hellaswag", "winogrande", "mathqa", "pubmedqa", "triviaqa"]


def build_adapter(
    model: Any, tokenizer: Any, cfg: EvalConfig, dp: DataParallelSplit | None = None, *, forward: Any = None
) -> Any:
    """An lm-eval ``LM`` over a sequential neox-forge model, or over a scoring function (``tokens -> logits``) and
    a generation ``forward`` (logits of the full vocabulary)."""
    device = inference_device()

    def score(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(tokens)

    return NeoXEvalAdapter(
        tokenizer=tokenizer,
        score_fn=score,
        forward=forward if forward is not None else kv_cache_forward(model),
        max_length=cfg.max_length,
        micro_batch_size=cfg.micro_batch_size,
        vocab_size=getattr(tokenizer, "vocab_size", None),
        device=device,
        dp=dp,
        seed=cfg.seed,
    )


def run_eval_harness(adapter: Any, cfg: EvalConfig, tasks: list[str] | None = None) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` over ``eval_tasks`` with ``eval_limit`` / ``eval_num_fewshot``."""
    import lm_eval  # optional heavy dependency: imported only when tasks are evaluated

    resolved = resolve_tasks(tasks if tasks is not None else cfg.eval_tasks)
    limit, seed = cfg.eval_limit, cfg.seed
    try:
        with _every_rank_reports():
            results = lm_eval.simple_evaluate(
                model=adapter,
                tasks=resolved.specs(),
                task_manager=resolved.manager,
                num_fewshot=cfg.eval_num_fewshot,
                limit=int(limit) if limit else None,
                bootstrap_iters=cfg.eval_bootstrap_iters,
                log_samples=False,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
    except ConnectionError as e:
        raise ValueError(f"eval_tasks: a task's dataset could not be downloaded ({e}); use a local task YAML") from e
    if results is None:
        raise RuntimeError("lm-eval returned no results")
    return results


@contextlib.contextmanager
def _every_rank_reports() -> Iterator[None]:
    """lm-eval returns results only where ``LOCAL_RANK`` is 0 (its guard for torchrun TP); every neox-forge rank
    evaluates the same requests (split inside the adapter), so each gets them.

    lm-eval's ``add_env_info`` (torch's ``collect_env``: pip and driver subprocesses, seconds per call and rank) is
    skipped: its fields are not part of GPT-NeoX's results file.
    """
    import lm_eval.evaluator

    saved, env_info = os.environ.get("LOCAL_RANK"), lm_eval.evaluator.add_env_info
    os.environ["LOCAL_RANK"] = "0"
    lm_eval.evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = env_info
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved


def flatten_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``{"<task>_<metric>": value}`` for every numeric, finite-or-not metric (stderr entries left out)."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or "_stderr" in key or "," not in key:
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[f"{task}_{name}"] = float(value)
    return out


def results_path(prefix: str | None, now: datetime | None = None) -> str:
    """GPT-NeoX's results file name ``[<prefix>_]eval_results_<m-d-Y-H-M-S>.json``."""
    name = f"eval_results_{(now or datetime.now()).strftime('%m-%d-%Y-%H-%M-%S')}.json"
    return f"{prefix}_{name}" if prefix else name


def write_results(
    results: dict[str, Any],
    config: dict[str, Any],
    path: str,
    *,
    batch_size: int,
    device: str,
    limit: int | None,
    bootstrap_iters: int = 0,
) -> None:
    """GPT-NeoX's results file: lm-eval's whole results dict (per-task ``alias`` entries dropped, as GPT-NeoX does)
    with ``config`` replaced by GPT-NeoX's ``{model: "neox", model_args: <every resolved key>, batch_size, device,
    use_cache, limit, bootstrap_iters}`` and ``git_hash``."""
    payload = {k: v for k, v in results.items() if k != "samples"}
    payload["results"] = {
        task: {k: v for k, v in metrics.items() if k != "alias"} for task, metrics in results.get("results", {}).items()
    }
    payload["config"] = {
        "model": "neox",
        "model_args": config,
        "batch_size": batch_size,
        "device": device,
        "use_cache": False,
        "limit": limit,
        "bootstrap_iters": bootstrap_iters,
    }
    payload["git_hash"] = config.get("git_hash")
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(payload, indent=4, default=_json_default, allow_nan=True), encoding="utf-8")
    tmp.replace(path)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)
