"""eval.py's lm-eval adapter against lm-eval's own ``hf`` backend on the convert_neox_to_hf export of the same
model, on the tasks shipped under configs/eval/ (multiple choice, generation with stop strings, rolling
perplexity): accuracies equal, log-likelihood metrics within 1e-4; GPT-NeoX's results file and eval/ scalars;
eval.py through deepy on 2 data-parallel ranks gives the same numbers; bad input fails clearly."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from megatron.neox_arguments import NeoXArgs
from tests.comet_archive import read_offline_archive
from tests.e2e.eval_fixture import REPO, TinyModel, build_tiny_model
from tests.harness import free_port, run_command

TASKS = str(REPO / "configs" / "eval")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TinyModel, str, dict[str, float], Path]]:
    """The tiny model, evaluated once by eval.py's code path in-process (1 rank)."""
    from megatron.evaluation.standalone import evaluate_checkpoint

    root = tmp_path_factory.mktemp("eval")
    saved = dict(os.environ)
    os.environ.update(OFFLINE, HF_HOME=str(root / "hf_home"))
    # an offline Comet experiment too (eval.py logs its scalars to every sink)
    os.environ.update(COMET_START_ONLINE="false", COMET_OFFLINE_DIRECTORY=str(root / "comet"))
    cwd = os.getcwd()
    try:
        setup = f"tensorboard_dir: {root / 'tb'}\neval_results_prefix: tiny\nuse_comet: true\n"
        tiny = build_tiny_model(root, setup=setup)
        os.chdir(root)
        args = NeoXArgs.from_ymls(tiny.configs, overwrite_values={"eval_tasks": [TASKS]})
        path, metrics = evaluate_checkpoint(args)
        assert path is not None
        yield tiny, path, metrics, root
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)


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


def _assert_same(metrics: dict[str, float], reference: dict[str, float]) -> None:
    assert set(metrics) == set(reference)
    for key, value in reference.items():
        if "acc" in key or "exact_match" in key:
            assert metrics[key] == value, key
        else:
            assert math.isclose(metrics[key], value, rel_tol=1e-4, abs_tol=1e-4), (key, metrics[key], value)


@pytest.mark.launches  # lm-eval's environment report runs `python -m pip list`
def test_eval_matches_lm_eval_hf_backend(evaluated, monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tiny, path, metrics, root = evaluated
    monkeypatch.setenv("HF_HOME", str(root / "hf_home"))
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    reference = _hf_reference(tiny.export)
    assert {"forge_mc_acc", "forge_mc_acc_norm", "forge_gen_exact_match_strip", "forge_ppl_word_perplexity"} <= set(
        reference
    )
    _assert_same(metrics, reference)

    # GPT-NeoX's file name and content
    assert Path(path).name.startswith("tiny_eval_results_") and path.endswith(".json")
    saved = json.loads(Path(path).read_text())
    assert saved["results"]["forge_mc"]["acc,none"] == metrics["forge_mc_acc"]
    assert saved["config"]["model"] == "neox" and saved["config"]["model_args"]["load"] == str(tiny.neox)
    assert "git_hash" in saved and "alias" not in saved["results"]["forge_mc"] and saved["n-shot"]["forge_mc"] == 0
    acc = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert acc.Scalars("eval/forge_mc_acc")[0].value == pytest.approx(metrics["forge_mc_acc"])
    (archive,) = (root / "comet").glob("*.zip")
    logged = read_offline_archive(archive)["metrics"]
    step = acc.Scalars("eval/forge_mc_acc")[0].step
    assert {k: v for k, v in logged.items() if k.startswith("eval/")} == {
        f"eval/{k}": [(step, v)] for k, v in metrics.items()
    }


@pytest.mark.slow  # with the module fixture (one evaluation): about 12 s
def test_generate_until_strings_match_hf_backend(evaluated) -> None:
    """The strings generate_until returns (greedy, stop strings, EOD) equal HFLM's on the export."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from megatron.evaluation.config import EvalConfig
    from megatron.evaluation.runner import build_adapter
    from megatron.generation.config import InferenceConfig
    from megatron.generation.text_generation import setup_for_inference

    tiny = evaluated[0]
    args = NeoXArgs.from_ymls(tiny.configs)
    model, tokenizer = setup_for_inference(InferenceConfig.from_neox_args(args))
    ours = build_adapter(model, tokenizer, EvalConfig.from_neox_args(args))
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


@pytest.mark.distributed
def test_eval_py_through_deepy_on_two_data_parallel_ranks(evaluated, tmp_path: Path) -> None:
    tiny, _, metrics, root = evaluated
    cfg: dict = {}
    for name in tiny.configs:
        cfg.update(yaml.safe_load(Path(name).read_text()))
    cfg.pop("global_num_gpus")
    cfg.update(num_gpus=2, train_micro_batch_size_per_gpu=1, master_port=free_port())
    config = tmp_path / "eval2.yml"
    config.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, str(REPO / "deepy.py"), str(REPO / "eval.py"), str(config), "--eval_tasks", TASKS]
    out = run_command(cmd, timeout=400, cwd=tmp_path, env={"HF_HOME": str(root / "hf_home")}).stdout
    files = list(tmp_path.glob("tiny_eval_results_*.json"))  # eval_results_prefix of the fixture
    assert len(files) == 1 and "wrote" in out
    from megatron.evaluation.runner import flatten_metrics

    _assert_same(flatten_metrics(json.loads(files[0].read_text())), metrics)


@pytest.mark.slow  # lm-eval's first task index: about 10 s
def test_clear_errors(evaluated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.evaluation.standalone import evaluate_checkpoint
    from megatron.evaluation.tasks import resolve_tasks

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as err:
        resolve_tasks([TASKS, "forge_mcc", "lambada_opena"])
    assert "unknown lm-eval task 'forge_mcc'; close matches: forge_mc" in str(err.value)
    assert "'lambada_opena'; close matches: lambada_openai" in str(err.value)
    with pytest.raises(ValueError, match=r"downloads the dataset .* offline .*configs/eval/"):
        resolve_tasks([TASKS, "lambada_openai"])  # the same task index as above (built once)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_tasks([str(tmp_path / "nothing.yaml")])
    with pytest.raises(ValueError, match="no tasks given"):
        resolve_tasks([])
    overrides = {"eval_tasks": [TASKS], "load": str(tmp_path / "no_ckpt")}
    args = NeoXArgs.from_ymls(evaluated[0].configs, overwrite_values=overrides)
    with pytest.raises(ValueError, match="no_ckpt"):
        evaluate_checkpoint(args)
