"""The planner's Mamba and RWKV formulas against the real layers: activation bytes equal the tensors autograd saves
in a tiny layer's forward, FLOPs are :mod:`megatron.logging.flops`'s, and ``deepy.py --plan`` plans both families."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
import yaml

import deepy
from megatron.logging.flops import FlopsConfig, flops_per_iteration
from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.mamba.segmented import DEFAULT_SEGMENT
from megatron.model.rwkv.wkv import DEFAULT_CHUNK
from megatron.planner.families import (
    MAMBA_SEGMENT,
    RWKV_CHUNK,
    gmlp_layer_bytes,
    mamba_layer_bytes,
    rwkv_layer_bytes,
)
from tests.model_configs import tiny_gpt_config


def _cfg(**kw: object) -> GPTModelConfig:
    return tiny_gpt_config(**{"norm": "rmsnorm", **kw})


def saved_tensor_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for ``layer``'s backward: every storage once, parameters and the input
    excluded, tensors of outputs the layer discards (freed before the backward) not counted."""
    refs: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer((x, None, None))
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    alive = [t for t in (r() for r in refs) if t is not None]
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
    assert out[0].requires_grad
    return sum(n for ptr, n in sizes.items() if ptr not in skip)


@pytest.mark.parametrize(
    ("s", "b", "h", "d", "norm"),
    [
        (16, 2, 32, 64, "rmsnorm"),
        (24, 3, 40, 48, "layernorm"),
        (32, 2, 64, 128, "scalenorm"),
        (8, 2, 24, 40, "rmsnorm"),
        (130, 2, 32, 64, "layernorm"),  # 3 segments of the scan, the last one short
        (200, 3, 48, 96, "rmsnorm"),
    ],
)
def test_mamba_activation_bytes_equal_saved_tensors(s: int, b: int, h: int, d: int, norm: str) -> None:
    assert MAMBA_SEGMENT == DEFAULT_SEGMENT  # the planner's segment is the scan's
    cfg = _cfg(hidden_size=h, intermediate_size=d, norm=norm, attention_config=[[["mamba"], 2]])
    x = torch.randn(s, b, h, requires_grad=True)
    assert saved_tensor_bytes(build_sequential_model(cfg).sequential[2], x) == mamba_layer_bytes(b, s, h, d, 1, norm)


@pytest.mark.parametrize("chunk", [4, RWKV_CHUNK, 16])
@pytest.mark.parametrize(
    ("s", "b", "h", "heads", "ffn"),
    # 48 / 40: 5 heads of 8; 144: 36, 18 or 9 chunks; 136 at chunk 8: 17 chunks, the scan pads them to 20
    [
        (16, 2, 32, 2, 96),
        (32, 3, 64, 4, 128),
        (48, 3, 40, 5, 72),
        (144, 2, 32, 2, 64),
        (64, 2, 64, 2, 100),
        (136, 2, 32, 4, 64),
    ],
)
def test_rwkv_activation_bytes_equal_saved_tensors(s: int, b: int, h: int, heads: int, ffn: int, chunk: int) -> None:
    if s % chunk:
        pytest.skip(f"seq {s} is not a multiple of chunk {chunk} (the formula counts whole chunks)")
    cfg = _cfg(hidden_size=h, num_attention_heads=heads, ffn_dim=ffn, attention_config=[[["rwkv"], 2]])
    layer = build_sequential_model(cfg).sequential[2]
    time_mix = next(m for m in layer.modules() if hasattr(m, "chunk"))
    assert time_mix.chunk == RWKV_CHUNK == DEFAULT_CHUNK  # the planner's chunk is the layer's
    time_mix.chunk = chunk
    x = torch.randn(s, b, h, requires_grad=True)
    assert saved_tensor_bytes(layer, x) == rwkv_layer_bytes(b, s, h, ffn, heads, chunk)


@pytest.mark.parametrize(
    ("kind", "s", "b", "h", "norm", "attn"),
    [("gmlp", 16, 2, 32, "rmsnorm", 0), ("gmlp", 24, 3, 16, "layernorm", 0), ("amlp", 16, 2, 32, "scalenorm", 8)],
)
def test_gmlp_activation_bytes_equal_saved_tensors(kind: str, s: int, b: int, h: int, norm: str, attn: int) -> None:
    kw = {"gmlp_attn_dim": attn} if attn else {}
    cfg = _cfg(hidden_size=h, norm=norm, seq_length=s, max_position_embeddings=s, attention_config=[[[kind], 2]], **kw)
    x = torch.randn(s, b, h, requires_grad=True)
    assert saved_tensor_bytes(build_sequential_model(cfg).sequential[2], x) == gmlp_layer_bytes(b, s, h, 1, norm, attn)


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert deepy.main(["--plan", "train.py", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_of_a_mamba_model_counts_its_saved_tensors_and_flops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/cpu/tiny.yml with Mamba layers (fp32, micro-batch 2, 64 tokens): the plan's activations are the
    measured saved bytes of its two layers, its FLOPs GPT-NeoX's Mamba formula (megatron/logging/flops.py)."""
    extra = tmp_path / "mamba.yml"
    extra.write_text(yaml.safe_dump({"attention_config": [[["mamba"], "all"]], "checkpoint_activations": False}))
    plan = _plan_json(capsys, "configs/cpu/tiny.yml", str(extra), "--vocab-size", "512")
    per_mb = plan["memory"]["per_rank"][0]["activations_per_micro_batch"]
    cfg = _cfg(hidden_size=64, norm="layernorm", attention_config=[[["mamba"], 2]])  # tiny.yml's norm
    layer = build_sequential_model(cfg).sequential[2]
    measured = saved_tensor_bytes(layer, torch.randn(64, 2, 64, requires_grad=True))
    assert per_mb["no_checkpointing_kept"] == 2 * measured
    flops = FlopsConfig(
        train_batch_size=2,
        seq_length=64,
        num_layers=2,
        hidden_size=64,
        padded_vocab_size=512,
        num_attention_heads=4,
        attention_config=["mamba", "mamba"],
    )
    assert plan["throughput"]["model_flops"] == flops_per_iteration(flops, 3)
    assert plan["throughput"]["predicted"]["model_flops"] == flops_per_iteration(flops, 3)
    assert "Mamba" in plan["formulas"]["flops"] and "⌈s/64⌉" in plan["formulas"]["activations_per_layer"]


def test_plan_of_the_shipped_rwkv_config(capsys: pytest.CaptureFixture[str]) -> None:
    """configs/rwkv/170M.yml (GPT-NeoX's) plans: RWKV FLOPs formula, RWKV activation count, exact parameters."""
    assert deepy.main(["--plan", "train.py", "configs/rwkv/170M.yml", "--vocab-size", "50304"]) == 0
    out = capsys.readouterr().out
    assert "GPT-NeoX's RWKV formula" in out and "T=8" in out
    plan = _plan_json(capsys, "configs/rwkv/170M.yml", "--vocab-size", "50304")
    h, layers, s, b = 768, 12, 512, 32  # the config's shape
    ffn = plan["memory"]["per_rank"][0]["activations_per_micro_batch"]
    assert ffn["no_checkpointing_kept"] == int(layers * rwkv_layer_bytes(b, s, h, 2688, 12))
    # checkpoint_activations is set, but RWKV blocks are not checkpointed: the plan keeps every layer's tensors
    assert plan["memory"]["per_rank"][0]["activations"] == ffn["no_checkpointing"] == ffn["checkpointing"]
    flops = (
        32 * s * (78.0 * layers * h * h + 84.0 * layers * h + 16.0 * h + 12.0 * h * 50304 + 18.0 * layers * h * h / 12)
    )
    assert plan["throughput"]["model_flops"] == pytest.approx(flops, rel=1e-12)


def test_plan_of_a_gmlp_model_counts_its_saved_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """configs/cpu/tiny.yml with gMLP layers: the plan's activations are the measured saved bytes of its layers."""
    extra = tmp_path / "gmlp.yml"
    extra.write_text(yaml.safe_dump({"attention_config": [[["gmlp"], "all"]], "checkpoint_activations": False}))
    plan = _plan_json(capsys, "configs/cpu/tiny.yml", str(extra), "--vocab-size", "512")
    per_mb = plan["memory"]["per_rank"][0]["activations_per_micro_batch"]
    cfg = _cfg(hidden_size=64, norm="layernorm", seq_length=64, attention_config=[[["gmlp"], 2]])
    measured = saved_tensor_bytes(build_sequential_model(cfg).sequential[2], torch.randn(64, 2, 64, requires_grad=True))
    assert per_mb["no_checkpointing_kept"] == 2 * measured
    assert plan["formulas"]["activations_per_layer"].startswith("4·(b·s·(p·h + p·f + 6·f)")
