"""Evaluation and generation choices measured against GPT-NeoX (docs/gpt-neox-differences.md): tasks are 0-shot
by default as GPT-NeoX forces, ``eval_num_fewshot: null`` gives each task's own; GPT-NeoX's results-file layout;
its default task list when ``eval_tasks`` is unset (offline: one line naming the dataset, before the checkpoint is
read); padded-vocabulary ids are never generated."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.neox_arguments import NeoXArgs
from tests.e2e.eval_fixture import REPO

WORDS = ["<|endoftext|>", "a", "b", "c", "d", "e", "f", "g"]
TINY = str(REPO / "configs/cpu/tiny.yml")
PADDED = 16  # the output layer's rows: ids 8..15 are padding


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real HFTokenizer over a word-level vocabulary (EOD 0, a 1, b 2, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from megatron.tokenizer import TokenizerConfig, build_tokenizer

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<|endoftext|>"])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=str(path)))


def padding_favoured(feed: torch.Tensor, cache: Any) -> torch.Tensor:
    """Logits over the padded vocabulary where the padding rows dominate (as in an untrained or badly tied model)."""
    g = torch.Generator().manual_seed(int(feed.sum()) + feed.shape[1])
    logits = torch.randn(feed.shape[0], feed.shape[1], PADDED, generator=g)
    logits[..., len(WORDS) :] += 20.0
    logits[..., 0] -= 50.0  # no end-of-document: every generation runs to maximum_tokens
    return logits


def test_padded_vocabulary_ids_are_never_generated(tokenizer: Any) -> None:
    from megatron.generation.api import generate_samples_from_prompt
    from megatron.generation.sampling import SamplingConfig

    assert tokenizer.vocab_size == len(WORDS)
    sampled = SamplingConfig(maximum_tokens=12, seq_length=64, temperature=1.0)
    greedy = SamplingConfig(maximum_tokens=12, seq_length=64)
    for cfg in (sampled, greedy):
        records = generate_samples_from_prompt(
            padding_favoured, tokenizer, ["a b", "c", "d e f"], cfg, return_logits=True, generator=torch.Generator()
        )
        for record in records:
            ids = tokenizer.tokenize(record["text"] or "")
            assert len(ids) == record["length"] == 12 and all(0 < t < len(WORDS) for t in ids)
            for row in map(torch.tensor, record["logits"]):  # rows keep the padded width, padding ids at -inf
                assert row.shape == (PADDED,) and torch.isneginf(row[len(WORDS) :]).all()
                assert torch.isfinite(row[: len(WORDS)]).all()
    # the test can fail: told the padded width is the vocabulary, the same model picks padding ids
    from megatron.generation.sampling import generate_tokens

    new, _ = generate_tokens(padding_favoured, [1, 2], greedy, eod_token=0, vocab_size=PADDED)
    assert new and all(t >= len(WORDS) for t in new)


def test_num_fewshot_default_is_gpt_neox_zero_shot(tmp_path: Path, tokenizer: Any) -> None:
    """A task whose YAML asks for 2 shots runs 0-shot by default (GPT-NeoX), 2-shot with eval_num_fewshot null."""
    from megatron.evaluation.adapter import NeoXEvalAdapter
    from megatron.evaluation.config import EvalConfig
    from megatron.evaluation.runner import run_eval_harness

    docs = [{"q": "a b", "choices": ["c", "d"], "label": i % 2} for i in range(4)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "shots.yaml").write_text(
        "task: fidelity_shots\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: docs.jsonl\n"
        "test_split: test\nfewshot_split: test\nnum_fewshot: 2\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    seen: list[int] = []

    def score(tokens: torch.Tensor) -> torch.Tensor:
        seen.append(tokens.shape[1])
        return padding_favoured(tokens, None)

    adapter = NeoXEvalAdapter(tokenizer=tokenizer, score_fn=score, forward=padding_favoured, max_length=64)
    overrides: dict[str, Any] = {"eval_tasks": [str(tmp_path / "shots.yaml")], "eval_limit": 2}
    args = NeoXArgs.from_ymls([TINY], overwrite_values=overrides)
    assert args.eval_num_fewshot == 0
    zero = run_eval_harness(adapter, EvalConfig.from_neox_args(args))
    assert zero["n-shot"]["fidelity_shots"] == 0 and max(seen) == 2  # "a b" + one choice, less the last token
    seen.clear()
    own_args = NeoXArgs.from_ymls([TINY], overwrite_values={**overrides, "eval_num_fewshot": None})
    assert own_args.eval_num_fewshot is None
    own = run_eval_harness(adapter, EvalConfig.from_neox_args(own_args))
    assert own["n-shot"]["fidelity_shots"] == 2 and max(seen) > 2
    assert own["results"]["fidelity_shots"]["acc_stderr,none"] == "N/A"  # eval_bootstrap_iters 0: not computed
    stderr_args = NeoXArgs.from_ymls([TINY], overwrite_values={**overrides, "eval_bootstrap_iters": 10})
    stderr = run_eval_harness(adapter, EvalConfig.from_neox_args(stderr_args))
    assert isinstance(stderr["results"]["fidelity_shots"]["acc_stderr,none"], float)


def test_results_file_has_gpt_neox_layout(tmp_path: Path) -> None:
    from megatron.evaluation.runner import results_path, write_results

    lm_eval_results = {
        "results": {"forge_mc": {"alias": "forge_mc", "acc,none": 0.5, "acc_stderr,none": "N/A"}},
        "versions": {"forge_mc": 1.0},
        "n-shot": {"forge_mc": 0},
        "configs": {"forge_mc": {"task": "forge_mc"}},
        "higher_is_better": {"forge_mc": {"acc": True}},
        "n-samples": {"forge_mc": {"original": 8, "effective": 8}},
        "config": {"model": "NeoXEvalAdapter"},
        "samples": {"forge_mc": []},
    }
    config = {"load": "ckpt", "git_hash": "abc123", "train_micro_batch_size_per_gpu": 2}
    path = str(tmp_path / results_path("run1", datetime(2026, 5, 19, 7, 8, 9)))
    assert path.endswith("run1_eval_results_05-19-2026-07-08-09.json")
    write_results(lm_eval_results, config, path, batch_size=4, device="cpu", limit=None)
    saved = json.loads(Path(path).read_text())
    assert saved["config"] == {
        "model": "neox",
        "model_args": config,
        "batch_size": 4,
        "device": "cpu",
        "use_cache": False,
        "limit": None,
        "bootstrap_iters": 0,
    }
    assert saved["results"] == {"forge_mc": {"acc,none": 0.5, "acc_stderr,none": "N/A"}}  # alias dropped
    assert saved["git_hash"] == "abc123" and "samples" not in saved
    for key in ("versions", "n-shot", "configs", "higher_is_better", "n-samples"):
        assert saved[key] == lm_eval_results[key]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow  # lm-eval's full task index: about 9 s
def test_unset_eval_tasks_means_gpt_neox_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, the first default task that needs a download is named, before the (missing) checkpoint is read."""
    from megatron.evaluation.runner import GPT_NEOX_DEFAULT_TASKS
    from megatron.evaluation.standalone import evaluate_checkpoint

    assert GPT_NEOX_DEFAULT_TASKS == ["lambada", "piqa", "hellaswag", "winogrande", "mathqa", "pubmedqa", "triviaqa"]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = NeoXArgs.from_ymls([TINY], overwrite_values={"load": str(tmp_path / "none")})
    assert not args.eval_tasks
    with pytest.raises(ValueError) as err:
        evaluate_checkpoint(args)
    message = str(err.value)
    assert "\n" not in message and "task 'lambada_openai' downloads the dataset 'EleutherAI/lambada_openai'" in message
