"""eval.py's lm-eval adapter against lm-eval's own ``hf`` backend on the convert_neox_to_hf export of the same
model, on the tasks shipped under configs/eval/ (multiple choice, generation with stop strings, rolling
perplexity): accuracies equal, log-likelihood metrics within 1e-4; GPT-NeoX's results file and eval/ scalars."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron.neox_arguments import NeoXArgs
from tests.e2e.eval_fixture import REPO, build_tiny_model

TASKS = str(REPO / "configs" / "eval")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _hf_reference(export: Path) -> dict[str, float]:
    import lm_eval

    from megatron.evaluation.runner import flatten_metrics
    from megatron.evaluation.tasks import resolve_tasks

    resolved = resolve_tasks([TASKS])
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},tokenizer={export},dtype=float32,device=cpu,max_length=64",
        tasks=resolved.specs(),
        task_manager=resolved.manager,
        batch_size=1,
        bootstrap_iters=0,
        log_samples=False,
    )
    return flatten_metrics(res)


def test_eval_matches_lm_eval_hf_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron.evaluation.standalone import evaluate_checkpoint

    tiny = build_tiny_model(tmp_path, setup=f"tensorboard_dir: {tmp_path / 'tb'}\neval_results_prefix: tiny\n")
    reference = _hf_reference(tiny.export)
    assert {"forge_mc_acc", "forge_mc_acc_norm", "forge_gen_exact_match_strip", "forge_ppl_word_perplexity"} <= set(
        reference
    )

    monkeypatch.chdir(tmp_path)
    args = NeoXArgs.from_ymls(tiny.configs, overwrite_values={"eval_tasks": [TASKS]})
    path, metrics = evaluate_checkpoint(args)
    assert set(metrics) == set(reference)
    for key, value in reference.items():
        if "acc" in key or "exact_match" in key:
            assert metrics[key] == value, key
        else:
            assert math.isclose(metrics[key], value, rel_tol=1e-4, abs_tol=1e-4), (key, metrics[key], value)

    # GPT-NeoX's file name and content
    assert path is not None and Path(path).name.startswith("tiny_eval_results_") and path.endswith(".json")
    saved = json.loads(Path(path).read_text())
    assert saved["results"]["forge_mc"]["acc,none"] == metrics["forge_mc_acc"]
    assert saved["config"]["load"] == str(tiny.neox) and "git_hash" in saved
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert acc.Scalars("eval/forge_mc_acc")[0].value == pytest.approx(metrics["forge_mc_acc"])
