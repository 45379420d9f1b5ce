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


def test_generate_until_strings_match_hf_backend(tmp_path: Path) -> None:
    """The strings generate_until returns (greedy, stop strings, EOD) equal HFLM's on the export."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from megatron.evaluation.runner import build_adapter
    from megatron.generation.text_generation import setup_for_inference

    tiny = build_tiny_model(tmp_path)
    args = NeoXArgs.from_ymls(tiny.configs)
    model, tokenizer = setup_for_inference(args)
    ours = build_adapter(model, tokenizer, args)
    ref = HFLM(pretrained=str(tiny.export), dtype="float32", device="cpu", batch_size=1, max_length=64)
    prompts = ["Q: What is 2 plus 2?\nA:", "The quick brown", "To be, or not", "Question: What color"]
    kwargs = [
        {"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
        {"until": ["fox", "dog"], "max_gen_toks": 20, "do_sample": False},
        {"until": [], "max_gen_toks": 30, "do_sample": False},
        {"until": "Answer", "max_gen_toks": 16},
    ]
    requests = [
        Instance(request_type="generate_until", doc={}, arguments=(p, k), idx=i)
        for i, (p, k) in enumerate(zip(prompts, kwargs, strict=True))
    ]
    got = ours.generate_until(requests)
    want = ref.generate_until([Instance(r.request_type, r.doc, (r.args[0], dict(r.args[1])), r.idx) for r in requests])
    assert got == want
    assert sum(len(s) for s in got) > 20  # real text came out, not only empty strings
    ll = [Instance("loglikelihood", {}, (p, " the"), i) for i, p in enumerate(prompts)]
    for (a, ga), (b, gb) in zip(ours.loglikelihood(ll), ref.loglikelihood(ll), strict=True):
        assert abs(a - b) < 1e-4 and ga == gb
