"""An all-Mamba checkpoint trained for real at TP=2 (2 steps, per-rank ``[x_r | z_r]`` in_proj shards) exports to
Hugging Face ``MambaForCausalLM`` with the logits of our TP=2 model; a mixed Mamba+attention one is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from megatron.checkpoint import cli
from tests.distributed.fns_ckpt import train_then_logits
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import load_tool, run_distributed

pytestmark = pytest.mark.distributed

MAMBA = {"pos_emb": "none", "norm": "rmsnorm", "rms_norm_epsilon": 1.0e-5, "precision": "fp32"}


def test_tp2_trained_mamba_checkpoint_exports_with_equal_logits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = make_tiny_data(tmp_path / "data")
    text = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    cases = {
        "mamba": tiny_config(
            data, world=2, model_parallel_size=2, pipe_parallel_size=1, train_iters=2, checkpoint_factor=2,
            eval_iters=1, save=str(tmp_path / "mamba"), attention_config=[[["mamba"], 2]], no_weight_tying=True,
            **MAMBA,
        ),
        "mixed": tiny_config(
            data, world=2, model_parallel_size=2, pipe_parallel_size=0, train_iters=1, checkpoint_factor=1,
            eval_iters=1, save=str(tmp_path / "mixed"), attention_config=[[["mamba", "global"], 1]], **MAMBA,
        ),
    }  # fmt: skip
    results = run_distributed(train_then_logits, 2, [(c, text) for c in cases.values()], timeout=600)
    ours = [r[0]["logits"] for r in results if r[0]["logits"] is not None]
    assert len(ours) == 1 and ours[0].shape == (2, 16, 512)
    step = tmp_path / "mamba" / "global_step2"
    assert {"layer_02-model_01-model_states.pt", "layer_03-model_00-model_states.pt"} <= {
        p.name for p in step.iterdir()
    }

    to_hf = load_tool("tools/ckpts/convert_neox_to_hf.py")
    out = tmp_path / "hf"
    argv = ["--input_dir", str(tmp_path / "mamba"), "--output_dir", str(out), "--architecture", "mamba"]
    assert cli.run(lambda: to_hf.main(argv)) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf) is transformers.MambaForCausalLM and not hf.config.tie_word_embeddings
    with torch.no_grad():
        assert (ours[0] - hf(text[:, :-1]).logits).abs().max().item() <= 1e-5

    mixed_out = tmp_path / "mixed-hf"
    argv = ["--input_dir", str(tmp_path / "mixed"), "--output_dir", str(mixed_out), "--architecture", "mamba"]
    capsys.readouterr()
    assert cli.run(lambda: to_hf.main(argv)) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attention_config mixes Mamba and global layers: Hugging Face has no model class" in err[0]
    assert not mixed_out.exists()
