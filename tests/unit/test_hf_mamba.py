"""All-Mamba models ⟷ Hugging Face ``MambaForCausalLM``: a random neox-forge Mamba model exported to HF gives the same
logits (HF's slow path on CPU), HF → NeoX (TP=2, per-rank ``[x_r | z_r]`` in_proj shards) → HF is bit-identical
through the real CLIs, and what HF cannot hold is refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatron.checkpoint import cli, export_hf, read_checkpoint
from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.hf_mapping import hf_config_to_neox, hf_to_neox_state_dict, neox_to_hf_config, neox_to_hf_state_dict
from tests.harness import load_tool

V = 96
TO_NEOX = load_tool("tools/ckpts/convert_hf_to_neox.py")
TO_HF = load_tool("tools/ckpts/convert_neox_to_hf.py")


def _cfg(**kw: object) -> GPTModelConfig:
    base: dict = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=V,
        max_position_embeddings=64,
        attention_config=[[["mamba"], 2]],
        norm="rmsnorm",
        rms_norm_epsilon=1e-5,
        pos_emb="none",
        seed=3,
    )
    base.update(kw)
    return GPTModelConfig(**base)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every tensor away from its init (norm scales and D off 1, biases off their init) so a swapped name shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize(
    "kw",
    [{}, {"no_weight_tying": True, "mamba_use_bias_in_conv": False, "intermediate_size": 96}],
    ids=["tied-conv-bias", "untied-no-conv-bias-expand3"],
)
def test_export_gives_same_logits_and_maps_back_exactly(kw: dict, tmp_path: Path) -> None:
    cfg = _cfg(**kw)
    model = build_sequential_model(cfg).eval()
    _randomise(model, 0)
    sd = model.state_dict()
    hf_config = neox_to_hf_config(cfg, "mamba")
    assert hf_config.intermediate_size == (kw.get("intermediate_size") or 64)
    assert hf_config.tie_word_embeddings is cfg.tied_embeddings
    hf = transformers.MambaForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(neox_to_hf_state_dict(sd, cfg, "mamba"), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tied_embeddings else set())
    ids = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=2e-5, rtol=1e-5)

    # HF → NeoX config and weights: the same model again, every tensor bit-identical
    cfg2, arch = hf_config_to_neox(hf_config)
    assert arch == "mamba"
    back = hf_to_neox_state_dict(hf.state_dict(), cfg2, "mamba")
    model2 = build_sequential_model(cfg2).eval()
    model2.load_state_dict(back, strict=True)
    for key, tensor in model2.state_dict().items():
        assert torch.equal(tensor, sd[key]), key

    # the exported folder: safetensors, loads with AutoModelForCausalLM, same logits
    out = export_hf(sd, cfg, tmp_path / "hf", architecture="mamba")
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(loaded) is transformers.MambaForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids), atol=2e-5, rtol=1e-5)


def _hf_mamba(path: Path, tied: bool) -> transformers.MambaForCausalLM:
    config = transformers.MambaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, expand=2, tie_word_embeddings=tied, layer_norm_epsilon=1e-5
    )
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config).float().eval()
    _randomise(model, 1)
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hf_to_neox_tp2_to_hf_is_bit_identical(tied: bool, tmp_path: Path) -> None:
    """Through the CLIs: the TP=2 checkpoint holds per-rank ``[x_r | z_r]`` in_proj shards; merged back they give the
    same HF tensors and config, and the NeoX model built from the merged TP=2 checkpoint gives HF's logits."""
    original = _hf_mamba(tmp_path / "hf", tied)
    neox, back = tmp_path / "neox", tmp_path / "back"
    argv = ["--input_dir", str(tmp_path / "hf"), "--output_dir", str(neox), "--tp", "2"]
    assert cli.run(lambda: TO_NEOX.main(argv)) == 0
    step = neox / "global_step0"
    x, z = original.backbone.layers[1].mixer.in_proj.weight.detach().chunk(2)
    for r in (0, 1):
        shard = torch.load(step / f"layer_03-model_0{r}-model_states.pt", weights_only=True)
        assert torch.equal(shard["mixer.in_proj.weight"], torch.cat([x.chunk(2)[r], z.chunk(2)[r]])), r
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    ckpt = read_checkpoint(step)
    assert ckpt.layout.tp == 2 and ckpt.cfg.layer_types == ("mamba", "mamba")
    neox_model = build_sequential_model(ckpt.cfg).eval()
    neox_model.load_state_dict(ckpt.state_dict, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(neox_model(ids), original(ids).logits, atol=2e-5, rtol=1e-5)

    argv2 = ["--input_dir", str(step), "--output_dir", str(back), "--architecture", "mamba"]
    assert cli.run(lambda: TO_HF.main(argv2)) == 0
    src, dst = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(dst) == set(src)
    for key, tensor in src.items():
        assert dst[key].dtype == tensor.dtype and torch.equal(dst[key], tensor), key
    a, b = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "hf", back))
    for key in ("vocab_size", "hidden_size", "state_size", "num_hidden_layers", "layer_norm_epsilon", "expand",
                "conv_kernel", "use_bias", "use_conv_bias", "time_step_rank", "intermediate_size",
                "tie_word_embeddings", "model_type", "architectures"):  # fmt: skip
        assert b[key] == a[key], key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)


def test_unsupported_mamba_exports_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"^attention_config mixes Mamba and global layers: Hugging Face has no model"):
        neox_to_hf_config(_cfg(attention_config=[[["mamba", "global"], 1]], pos_emb="rotary"), "mamba")
    with pytest.raises(ValueError, match="attention_config mixes Mamba and global layers"):
        neox_to_hf_config(_cfg(attention_config=[[["mamba", "global"], 1]], pos_emb="rotary"), "llama")
    cases = {
        "pos_emb='learned'": dict(pos_emb="learned"),
        "norm='layernorm'": dict(norm="layernorm"),
        "mamba_use_bias_in_linears": dict(mamba_use_bias_in_linears=True),
        "is not a multiple of hidden_size=32": dict(intermediate_size=48),
        "has no 'mamba' layers": dict(attention_config=None, pos_emb="rotary"),
    }
    for needle, kw in cases.items():
        with pytest.raises(ValueError, match=r"no exact MambaForCausalLM equivalent: .*" + needle.replace("(", r"\(")):
            neox_to_hf_config(_cfg(**kw), "mamba")
    with pytest.raises(ValueError, match="attention_config 'mamba' layers \\(use architecture 'mamba'"):
        neox_to_hf_config(_cfg(), "neox")
    hf = transformers.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2)
    for field, value, needle in (
        ("state_size", 8, "state_size=8 is not supported"),
        ("conv_kernel", 3, "conv_kernel=3 is not supported"),
        ("time_step_rank", 4, "time_step_rank=4 is not supported"),
        ("use_bias", True, "use_bias=true is not supported"),
        ("hidden_act", "gelu", "hidden_act='gelu' is not supported"),
    ):
        bad = transformers.MambaConfig(**{**hf.to_dict(), field: value})
        with pytest.raises(ValueError, match=needle):
            hf_config_to_neox(bad)
