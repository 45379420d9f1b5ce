"""The planner's real FLOPs of gMLP/aMLP blocks and sparse attention layers (``megatron/planner/layer_flops.py``):
the gMLP/aMLP counts equal ``FlopCounterMode``'s count of a real block's forward and backward, the sparse counts
equal the dense formula less the masked blocks of the model's own layouts, and ``--plan`` uses them for the step
time while the logged FLOPs stay GPT-NeoX's formula."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

import deepy
from megatron.logging.flops import FlopsConfig, flops_per_iteration
from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.sparse_attention import SparseAttention
from megatron.neox_arguments.sparse_layouts import SPARSE_TYPES
from megatron.planner.layer_flops import (
    forward_flops_delta,
    gmlp_layer_forward,
    sparse_kept_fractions,
    transformer_layer_forward,
)
from tests.model_configs import tiny_gpt_config


def _cfg(**kw: object) -> GPTModelConfig:
    return tiny_gpt_config(**kw)


@pytest.mark.parametrize(
    ("kind", "s", "b", "h", "attn_dim"),
    [("gmlp", 16, 2, 32, 0), ("gmlp", 24, 3, 40, 0), ("amlp", 16, 2, 32, 8), ("amlp", 32, 1, 24, 64)],
)
def test_gmlp_block_flops_equal_the_measured_count(kind: str, s: int, b: int, h: int, attn_dim: int) -> None:
    """One real block (layer spec 2), forward and then backward, counted by torch's FlopCounterMode (matrix
    multiplies: linear, einsum's bmm): the forward equals ``b ·`` the formula exactly, the backward twice it."""
    cfg = _cfg(hidden_size=h, seq_length=s, attention_config=[[[kind], 2]], gmlp_attn_dim=attn_dim or 64)
    layer = build_sequential_model(cfg).sequential[2]
    x = torch.randn(s, b, h, requires_grad=True)
    with FlopCounterMode(display=False) as forward:
        out = layer((x, None, None))[0]
    with FlopCounterMode(display=False) as backward:
        out.square().sum().backward()
    expected = b * gmlp_layer_forward(s, h, tp=1, attn_dim=attn_dim)
    assert forward.get_total_flops() == expected
    assert backward.get_total_flops() == 2 * expected
    if kind == "gmlp":  # the transformer formula's layer differs by the sequence projection's 4·s²·h
        assert expected - b * transformer_layer_forward(s, h) == b * 4 * s * s * h


def _model_kept(cfg: GPTModelConfig) -> list[float]:
    """Each sparse layer's kept causal block fraction, read from the built model's own layouts."""
    fractions = []
    for module in build_sequential_model(cfg).modules():
        if isinstance(module, SparseAttention):
            layout = module.layout.tril()  # [heads, n, n]: the causal blocks the kernel computes
            fractions.append(float(layout.sum()) / layout.numel())
    return fractions


@pytest.mark.parametrize("kind", SPARSE_TYPES)
def test_kept_fractions_are_the_models_layouts(kind: str) -> None:
    """Per layer (random blocks differ per layer), the planner's fraction is the model layer's layout's."""
    sparsity = {"block": 4, "different_layout_per_head": True, "num_random_blocks": 1}
    sparsity = {k: v for k, v in sparsity.items() if kind in ("bigbird", "sparse_variable") or k == "block"}
    cfg = _cfg(num_layers=3, seq_length=64, attention_config=[[[kind], 3]], sparsity_config=sparsity, seed=11)
    kept = sparse_kept_fractions([kind] * 3, sparsity, 4, 64, 11)
    assert list(kept) == pytest.approx(_model_kept(cfg), rel=1e-12)
    assert all(0 < k < 0.75 for k in kept)  # 16 blocks a row: every pattern drops blocks


def test_dense_layers_keep_everything_and_mixed_models_count_per_layer() -> None:
    kinds = ["global", "local", "flash", "gmlp"]
    kept = sparse_kept_fractions(kinds, {"block": 8}, 4, 64, 1)
    assert kept[0] == kept[2] == kept[3] == 1.0 and kept[1] < 1.0
    s, h = 64, 32
    delta = forward_flops_delta(kinds, s, h, sparse_kept=kept)
    assert delta == pytest.approx(4 * s * s * h * (kept[1] - 1) + 4 * s * s * h, rel=1e-12)
    assert forward_flops_delta(["global", "flash"], s, h) == 0.0
    assert forward_flops_delta(["rwkv", "rwkv"], s, h) == 0.0  # GPT-NeoX's RWKV formula counts the whole model


def _plan(capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: dict) -> dict:
    path = tmp_path / "extra.yml"
    path.write_text(yaml.safe_dump({"checkpoint_activations": False, **extra}))
    argv = ["--plan", "train.py", "configs/cpu/tiny.yml", str(path), "--vocab-size", "512", "--json"]
    assert deepy.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _logged(kinds: list[str], k: int = 3) -> float:
    """GPT-NeoX's formula for configs/cpu/tiny.yml (B 2, s 64, h 64, 2 layers, V 512)."""
    cfg = FlopsConfig(
        train_batch_size=2, seq_length=64, num_layers=2, hidden_size=64, padded_vocab_size=512, attention_config=kinds
    )
    return flops_per_iteration(cfg, k)


def test_plan_of_a_sparse_model_removes_the_masked_blocks_share(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """tiny.yml with bigbird layers (block 8, 1 random block a row): the step time's FLOPs are the dense formula less
    ``K·B·4·s²·h`` times each layer's masked share of its model layout; the logged FLOPs stay dense."""
    sparsity = {"block": 8, "num_random_blocks": 1}
    plan = _plan(capsys, tmp_path, {"attention_config": [[["bigbird"], "all"]], "sparsity_config": sparsity})
    cfg = _cfg(hidden_size=64, seq_length=64, attention_config=[[["bigbird"], 2]], sparsity_config=sparsity, seed=1234)
    kept = _model_kept(cfg)
    b, s, h = 2, 64, 64
    masked = sum(3 * b * 4 * s * s * h * (1 - f) for f in kept)
    assert masked > 0
    throughput = plan["throughput"]
    assert throughput["model_flops"] == _logged(["bigbird"] * 2)  # as GPT-NeoX logs it
    assert throughput["compute_flops"] == pytest.approx(_logged(["bigbird"] * 2) - masked, rel=1e-12)
    assert throughput["predicted"]["gemm_flops"] == pytest.approx(throughput["compute_flops"], rel=1e-12)
    assert throughput["predicted"]["model_flops"] == _logged(["bigbird"] * 2)
    assert "kept blocks" in plan["formulas"]["compute_flops"]
    # the MFU is the logged one: GPT-NeoX's model FLOPs over the (shorter) step time
    assert throughput["mfu"] == pytest.approx(_logged(["bigbird"] * 2) / (throughput["step_s"] * 312e12), rel=1e-12)


def test_plan_of_an_amlp_model_counts_its_blocks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """tiny.yml with aMLP layers: the step time's FLOPs replace the formula's layers by the measured block count."""
    plan = _plan(capsys, tmp_path, {"attention_config": [[["amlp"], "all"]], "gmlp_attn_dim": 16})
    b, s, h = 2, 64, 64
    layers = 2 * 3 * b * (gmlp_layer_forward(s, h, 1, 16) - transformer_layer_forward(s, h))
    throughput = plan["throughput"]
    assert throughput["model_flops"] == throughput["hardware_flops"] == _logged(["amlp"] * 2)
    assert throughput["compute_flops"] == pytest.approx(_logged(["amlp"] * 2) + layers, rel=1e-12)
    assert throughput["compute_s"] == pytest.approx(throughput["compute_flops"] / 312e12, rel=1e-12)
    assert throughput["predicted"]["gemm_flops"] == pytest.approx(throughput["compute_flops"], rel=1e-12)


def test_plan_of_a_dense_model_has_no_separate_compute_count(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan = _plan(capsys, tmp_path, {})
    assert plan["throughput"]["compute_flops"] == plan["throughput"]["hardware_flops"]
    assert "compute_flops" not in plan["formulas"]


@pytest.mark.parametrize("kinds", [["gmlp", "amlp"], ["bigbird", "local"], ["sparse_fixed", "global"]])
def test_logged_flops_count_gmlp_and_sparse_layers_as_gpt_neox_does(kinds: list[str]) -> None:
    """GPT-NeoX's ``get_flops`` (megatron/logging.py at ea7aefd8) has no gMLP or sparse branch: its transformer
    formula, which the logged figure keeps."""
    b, s, layers, h, v = 2, 64, 2, 64, 512
    gpt_neox = 24 * 3 * b * s * layers * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * layers * h))
    assert _logged(kinds) == pytest.approx(gpt_neox, rel=1e-15)
    assert _logged(kinds, 4) == pytest.approx(gpt_neox * 4 / 3, rel=1e-15)
