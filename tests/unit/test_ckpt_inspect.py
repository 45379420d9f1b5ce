"""tools/ckpts/inspect_checkpoints.py: list a checkpoint's layout/tensors, diff checkpoints across layouts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from megatron.checkpoint import TargetLayout, cli, write_checkpoint
from megatron.checkpoint.hf_io import neox_config_yaml
from megatron.model import GPTModelConfig, build_sequential_model

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("inspect_checkpoints", REPO / "tools/ckpts/inspect_checkpoints.py")
assert spec and spec.loader
INSPECT = importlib.util.module_from_spec(spec)
spec.loader.exec_module(INSPECT)


def test_list_and_diff_across_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = GPTModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=64,
        pos_emb="rotary",
        max_position_embeddings=64,
        no_weight_tying=True,
    )
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(v.shape, generator=g) for k, v in build_sequential_model(cfg).state_dict().items()}
    configs = {"model.yml": neox_config_yaml(cfg, 1, 0)}
    write_checkpoint(full, cfg, tmp_path / "a", TargetLayout(2, 2), iteration=5, config_files=configs)
    write_checkpoint(full, cfg, tmp_path / "b", TargetLayout(1, 0), iteration=5, config_files=configs)

    assert cli.run(lambda: INSPECT.main([str(tmp_path / "a")])) == 0
    out = capsys.readouterr().out
    assert "layout tp=2 pp=2 (pipe)" in out and "iteration 5" in out and "configs manifest.json" not in out
    assert (
        "== layer_02-model_01-model_states.pt" in out and "attention.query_key_value.weight  (48, 32)  float32" in out
    )

    assert cli.run(lambda: INSPECT.main([str(tmp_path / "a"), "--diff", str(tmp_path / "b")])) == 0
    assert "checkpoints are identical" in capsys.readouterr().out

    changed = dict(full)
    changed["sequential.3.mlp.linear2.bias"] = full["sequential.3.mlp.linear2.bias"] + 0.5
    write_checkpoint(changed, cfg, tmp_path / "c", TargetLayout(1, 1), iteration=6, config_files=configs)
    assert cli.run(lambda: INSPECT.main([str(tmp_path / "a"), "--diff", str(tmp_path / "c")])) == 2
    out = capsys.readouterr().out
    assert "sequential.3.mlp.linear2.bias: max abs diff 0.5" in out and "iteration: 5 vs 6" in out
    assert len(out.strip().splitlines()) == 2

    single = tmp_path / "a" / "global_step5" / "layer_05-model_00-model_states.pt"
    assert cli.run(lambda: INSPECT.main([str(single)])) == 0
    assert "norm.weight  (32,)  float32" in capsys.readouterr().out
    assert cli.run(lambda: INSPECT.main([str(tmp_path / "missing")])) == 1
    assert "does not exist" in capsys.readouterr().err


def test_gpt_neox_config_files_give_the_hf_config() -> None:
    from megatron.checkpoint.config_io import load_neox_args, model_config
    from megatron.model.hf_mapping import neox_to_hf_config

    cfg = model_config(load_neox_args([REPO / "configs/pythia/14M.yml"]), padded_vocab_size=50304)
    hf = neox_to_hf_config(cfg, "neox")
    assert (hf.hidden_size, hf.num_hidden_layers, hf.vocab_size) == (128, 6, 50304)
    assert hf.use_parallel_residual and not hf.tie_word_embeddings
    assert hf.rope_parameters["partial_rotary_factor"] == 0.25 and hf.hidden_act == "gelu_pytorch_tanh"
    llama = model_config(load_neox_args([REPO / "configs/llama2/7B.yml"]), padded_vocab_size=32000)
    hf = neox_to_hf_config(llama, "llama")
    assert (hf.intermediate_size, hf.hidden_act, hf.num_key_value_heads) == (11008, "silu", 32)


def test_tools_run_as_scripts(tmp_path: Path) -> None:
    from tests.harness import PYTHON, run_command

    cfg = GPTModelConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=64,
        pos_emb="rotary",
        max_position_embeddings=64,
    )
    full = build_sequential_model(cfg).state_dict()
    write_checkpoint(full, cfg, tmp_path / "ck", TargetLayout(2, 0), iteration=3)
    listed = run_command([PYTHON, "tools/ckpts/inspect_checkpoints.py", str(tmp_path / "ck")], timeout=300)
    assert "layout tp=2 pp=0 (sequential)" in listed.stdout and "iteration 3" in listed.stdout
    bad = run_command(
        [PYTHON, "tools/ckpts/reshard_checkpoint.py", "--input_dir", str(tmp_path / "none"), "--output_dir",
         str(tmp_path / "out"), "--tp", "1", "--pp", "0"], timeout=300, check=False,
    )  # fmt: skip
    assert bad.returncode == 1 and "does not exist" in bad.stderr and not (tmp_path / "out").exists()
