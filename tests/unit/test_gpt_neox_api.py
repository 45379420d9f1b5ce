"""GPT-NeoX's scripting names over our package: signatures as GPT-NeoX's (facts from its code at ea7aefd), and each
does the real thing on a tiny config. The in-process training/generation flow is tests/e2e/test_gpt_neox_api_flow.py."""

from __future__ import annotations

import base64
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.neox_arguments import ConfigError, NeoXArgs
from tests.harness import REPO_ROOT, load_tool
from tests.unit.test_neox_compat_api import TINY as COMPAT_TINY

TINY = {
    **COMPAT_TINY,
    "tokenizer_type": "CharLevelTokenizer",
    "user_script": "train.py",
}
RANK_KEYS = {"rank", "local_rank", "world_size"}  # set on the worker from its environment


def _params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_get_deepspeed_main_args_round_trips_through_consume_neox_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    args = NeoXArgs.from_dict({**TINY, "num_gpus": 1, "include": "localhost:0"})
    argv = args.get_deepspeed_main_args()
    # GPT-NeoX's shape: runner flags that differ from the defaults, the script, then the two base64 JSON configs
    assert argv[:3] == ["--include", "localhost:0", "train.py"]  # include wins over num_gpus, as in GPT-NeoX
    assert argv[3] == "--deepspeed_config" and argv[5] == "--megatron_config"
    ds = json.loads(base64.urlsafe_b64decode(argv[4]))
    assert ds == args.deepspeed_config and ds["train_micro_batch_size_per_gpu"] == 2
    back = NeoXArgs.consume_neox_args(input_args=argv, overwrite_values={"seed": 7})
    want = {**args.to_dict(), "seed": 7}
    got = back.to_dict()
    assert {k: v for k, v in got.items() if k not in RANK_KEYS} == {k: v for k, v in want.items() if k not in RANK_KEYS}
    with pytest.raises(ConfigError, match="user_script"):
        NeoXArgs.from_dict({k: v for k, v in TINY.items() if k != "user_script"}).get_deepspeed_main_args()


def test_introspection_names() -> None:
    from megatron.neox_arguments.neox_args import NeoXArgsDeepspeedConfig, NeoXArgsModel, NeoXArgsTokenizer

    assert NeoXArgs.validate_keys() is True
    fields = NeoXArgs.__dataclass_fields__
    assert {"hidden_size", "tokenizer_type", "zero_optimization", "hostfile"} <= set(fields)
    assert NeoXArgsTokenizer.tokenizer_type == "GPT2BPETokenizer"  # GPT-NeoX's default, read off the class
    assert "hidden_size" in NeoXArgsModel.__dataclass_fields__ and "zero_optimization" in dir(NeoXArgsDeepspeedConfig)
    args = NeoXArgs.from_dict(TINY)
    assert args.megatron_config["hidden_size"] == 64 and "hostfile" not in args.megatron_config
    assert args.all_config == args.to_dict() and "num_gpus" in args.deepspeed_runner


def test_build_tokenizer_sets_padded_vocab() -> None:
    import megatron.tokenizer  # noqa: F401 - hands NeoXArgs.build_tokenizer() its builder (GPT-NeoX's imports do)

    args = NeoXArgs.from_dict(TINY)
    tokenizer = args.build_tokenizer()
    assert args.tokenizer is tokenizer and args.padded_vocab_size == 512


def test_build_tokenizer_works_after_gpt_neox_train_py_imports_and_says_what_is_missing_before() -> None:
    """The config layer reaches the tokenizer layer above it only through the builder that layer hands down on
    import (no import of the package root or the tokenizer from the config layer): after GPT-NeoX's train.py imports
    it works; with the config package alone, one line names the fix."""
    import subprocess
    import textwrap

    script = textwrap.dedent(
        f"""\
        from megatron.neox_arguments import NeoXArgs
        args = NeoXArgs.from_dict({TINY!r})
        try:
            args.build_tokenizer()
        except RuntimeError as e:
            print("before:", e)
        from megatron.training import pretrain  # GPT-NeoX's train.py imports
        print("after:", args.build_tokenizer() is args.tokenizer, args.padded_vocab_size)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("before: NeoXArgs.build_tokenizer(): the tokenizer package is not loaded; import ")
    assert lines[-1] == "after: True 512"


def test_entry_points_take_gpt_neox_arguments() -> None:
    sys.path.insert(0, str(REPO_ROOT))
    import eval as eval_script
    import generate
    import train

    for fn in (train.main, generate.main, eval_script.main, load_tool("tools/ckpts/convert_neox_to_hf.py").main):
        assert _params(fn) == [("input_args", None), ("overwrite_values", None)]
    for path in ("train.py", "generate.py", "eval.py"):
        assert len((REPO_ROOT / path).read_text().splitlines()) <= 80


def test_module_layout_signatures() -> None:
    import megatron
    from megatron import initialize_megatron
    from megatron.checkpointing import load_checkpoint, save_checkpoint
    from megatron.text_generation_utils import generate_samples_from_prompt
    from megatron.training import pretrain, setup_model_and_optimizer

    assert megatron.initialize_megatron is initialize_megatron
    assert _params(save_checkpoint) == [
        (n, inspect.Parameter.empty) for n in ("neox_args", "iteration", "model", "optimizer", "lr_scheduler")
    ]
    assert _params(load_checkpoint)[-2:] == [("inference", False), ("iteration", None)]
    assert _params(setup_model_and_optimizer) == [
        ("neox_args", inspect.Parameter.empty),
        ("use_cache", False),
        ("iteration", None),
    ]
    assert _params(initialize_megatron) == [("neox_args", inspect.Parameter.empty), ("allow_no_cuda", False)]
    assert _params(pretrain) == [("neox_args", inspect.Parameter.empty)]
    names = [n for n, _ in _params(generate_samples_from_prompt)]
    assert names == ["neox_args", "model", "text", "eos_token_id", "maximum_tokens", "recompute", "temperature",
                     "top_k", "top_p", "stop_tokens"]  # fmt: skip


def test_is_mp_rank_0_without_model_parallel() -> None:
    from megatron.utils import is_mp_rank_0

    assert is_mp_rank_0() is True


def test_fused_kernels_and_fused_softmax() -> None:
    from megatron import fused_kernels
    from megatron.model.fused_softmax import FusedScaleMaskSoftmax, SoftmaxFusionTypes

    fused_kernels.load()
    fused_kernels.load_fused_kernels()
    torch.manual_seed(0)
    scores = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16)
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)

    def mask_func(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(m, -10000.0)

    softmax = FusedScaleMaskSoftmax(False, True, SoftmaxFusionTypes.upper_triang, mask_func, True, 0.5)
    out = softmax(scores, mask)
    want = torch.softmax(mask_func(scores.float() * 0.5, mask), dim=-1).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, want) and out[0, 0, 0, 1] == 0
    with pytest.raises(ValueError, match="softmax_in_fp32"):
        FusedScaleMaskSoftmax(False, True, SoftmaxFusionTypes.general, mask_func, False, 0.5)


def test_train_iters_zero_is_accepted() -> None:
    args = NeoXArgs.from_dict({**TINY, "train_iters": 0, "extra_save_iters": [0], "save": "ckpt"})
    assert args.train_iters == 0
    with pytest.raises(ConfigError, match="train_iters"):
        NeoXArgs.from_dict({**TINY, "train_iters": -1})


def test_deepy_eval_tasks_list_literal(tmp_path: Path) -> None:
    from megatron.neox_arguments.deepy_cli import parse_deepy_args

    script = str(REPO_ROOT / "eval.py")
    assert parse_deepy_args([script, "a.yml", "--eval_tasks", '["lambada", "piqa"]']).overrides["eval_tasks"] == [
        "lambada",
        "piqa",
    ]
    assert parse_deepy_args([script, "a.yml", "--eval_tasks", "lambada", "piqa"]).overrides["eval_tasks"] == [
        "lambada",
        "piqa",
    ]
    assert parse_deepy_args([script, "a.yml", "--extra_save_iters", "[0,1]"]).overrides["extra_save_iters"] == [0, 1]


def test_train_tokenizer_plain_text_and_no_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megatron.tokenizer import train_tokenizer

    text = tmp_path / "enwik8_first100.txt"
    text.write_text("".join(f"line {i} of some plain text\n" for i in range(100)))
    args = train_tokenizer.parse_args(["--json_input_dir", str(text), "--tokenizer_output_path", "", "-v", "300"])
    train_tokenizer.main(args)  # GPT-NeoX's own test: a text file and no output path
    assert "trained (not saved)" in capsys.readouterr().out and not list(tmp_path.glob("*.json"))
    out = tmp_path / "tok.json"
    size = train_tokenizer.train_tokenizer(str(text), str(out), vocab_size=300)
    assert json.loads(out.read_text())["model"]["type"] == "BPE" and 256 < size <= 300


def test_pretrain_is_a_plain_function_after_the_run_module_is_loaded() -> None:
    """GPT-NeoX's ``from megatron.training import pretrain`` names a function, not a module that is also callable
    (the run's module, loaded here through the API module as ``train.py`` loads it, must not shadow the name)."""
    import types

    import megatron.training.gpt_neox_api  # noqa: F401 - loads the module that holds the run
    from megatron.training import pretrain

    assert inspect.isfunction(pretrain) and not isinstance(pretrain, types.ModuleType)


def test_gpt2_attention_mask_func_and_loss_hook_names() -> None:
    import megatron.training
    from megatron.model.gpt2_model import gpt2_attention_mask_func

    scores = torch.zeros(1, 1, 2, 2)
    out = gpt2_attention_mask_func(scores, torch.tensor([[[[False, True], [False, False]]]]))
    assert out is scores and scores[0, 0, 0, 1] == torch.finfo(torch.float32).min and scores[0, 0, 1, 1] == 0
    with pytest.raises(AttributeError, match="on_step"):  # GPT-NeoX's test hook: not in our loop
        megatron.training.collect_loss_for_unit_test  # noqa: B018
