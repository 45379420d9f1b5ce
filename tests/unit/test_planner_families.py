"""The planner's Mamba and RWKV formulas against the real layers: activation bytes equal the tensors autograd saves
in a tiny layer's forward, FLOPs are :mod:`megatron.logging.flops`'s, and ``deepy.py --plan`` plans both families."""

from __future__ import annotations

import weakref

import pytest
import torch

from megatron.model import GPTModelConfig, build_sequential_model
from megatron.planner.families import mamba_layer_bytes, rwkv_layer_bytes


def _cfg(**kw: object) -> GPTModelConfig:
    base: dict[str, object] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=128,
        max_position_embeddings=64,
        norm="rmsnorm",
        pos_emb="none",
        seed=3,
    )
    base.update(kw)
    return GPTModelConfig(**base)  # type: ignore[arg-type]


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


@pytest.mark.parametrize(("s", "b", "h", "d"), [(16, 2, 32, 64), (24, 3, 40, 48), (32, 2, 64, 128)])
def test_mamba_activation_bytes_equal_saved_tensors(s: int, b: int, h: int, d: int) -> None:
    layer = build_sequential_model(_cfg(hidden_size=h, intermediate_size=d, attention_config=[[["mamba"], 2]]))
    x = torch.randn(s, b, h, requires_grad=True)
    assert saved_tensor_bytes(layer.sequential[2], x) == mamba_layer_bytes(b, s, h, d)


@pytest.mark.parametrize(("s", "b", "h", "heads", "ffn"), [(16, 2, 32, 2, 96), (32, 3, 64, 4, 128)])
def test_rwkv_activation_bytes_equal_saved_tensors(s: int, b: int, h: int, heads: int, ffn: int) -> None:
    cfg = _cfg(hidden_size=h, num_attention_heads=heads, ffn_dim=ffn, attention_config=[[["rwkv"], 2]])
    x = torch.randn(s, b, h, requires_grad=True)
    assert saved_tensor_bytes(build_sequential_model(cfg).sequential[2], x) == rwkv_layer_bytes(b, s, h, ffn, heads)
