"""MoE ⟷ Hugging Face ``MixtralForCausalLM`` (built from a config, no downloads): logits, loss and gradients
≤ 1e-5 (fp32), the mapping round trip, HF's older per-expert names, and refusals where Mixtral differs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from megatron.model import GPTModelConfig, build_sequential_model, cross_entropy
from megatron.model.hf_mapping import hf_config_to_neox, hf_to_neox_state_dict, neox_to_hf_config, neox_to_hf_state_dict
from tests.unit.test_hf_parity import VOCAB, _llama, _randomise

TOL = 1e-5


def _mixtral(**kw) -> transformers.MixtralConfig:
    base = dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    return _llama("mixtral", **{**base, **kw})


def _pair(hf_config: transformers.MixtralConfig, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.MixtralForCausalLM(hf_config).float().eval()
    _randomise(hf, seed)
    cfg, arch = hf_config_to_neox(hf_config)
    assert arch == "mixtral" and cfg.moe_num_experts == 4 and cfg.moe_ffn_size == 48
    ours = build_sequential_model(cfg).eval()
    ours.load_state_dict(hf_to_neox_state_dict(hf.state_dict(), cfg, arch), strict=True)
    return hf, ours, cfg, arch


@pytest.mark.parametrize("top_k", [1, 2])
def test_mixtral_logits_loss_and_grads_match(top_k: int) -> None:
    hf, ours, cfg, arch = _pair(_mixtral(num_experts_per_tok=top_k), seed=top_k)
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= TOL
    hf_loss = hf(ids, labels=ids).loss
    hf_loss.backward()
    labels = torch.cat((ids[:, 1:], torch.zeros_like(ids[:, :1])), dim=1)
    mask = torch.ones(ids.shape)
    mask[:, -1] = 0.0
    loss = cross_entropy(ours(ids), (labels, mask))
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= TOL
    mapped = neox_to_hf_state_dict({k: p.grad for k, p in ours.named_parameters()}, cfg, arch)
    hf_params = dict(hf.named_parameters())
    assert set(mapped) == set(hf_params)
    for key, grad in mapped.items():
        assert (grad - hf_params[key].grad).abs().max().item() <= TOL, key


def test_mixtral_round_trip_and_legacy_expert_names() -> None:
    hf_config = _mixtral()
    hf, ours, cfg, arch = _pair(hf_config)
    back = neox_to_hf_state_dict(ours.state_dict(), cfg, arch)
    hf_sd = hf.state_dict()
    assert set(back) == set(hf_sd) and all(torch.equal(v, hf_sd[k]) for k, v in back.items())
    regenerated = neox_to_hf_config(cfg, arch)
    for field in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "num_key_value_heads"):
        assert getattr(regenerated, field) == getattr(hf_config, field), field

    legacy = {k: v for k, v in hf_sd.items() if ".mlp." not in k}
    for i in range(2):
        pre = f"model.layers.{i}."
        legacy[pre + "block_sparse_moe.gate.weight"] = hf_sd[pre + "mlp.gate.weight"]
        gate_up, down = hf_sd[pre + "mlp.experts.gate_up_proj"], hf_sd[pre + "mlp.experts.down_proj"]
        for e in range(4):
            legacy[f"{pre}block_sparse_moe.experts.{e}.w1.weight"] = gate_up[e, :48]
            legacy[f"{pre}block_sparse_moe.experts.{e}.w3.weight"] = gate_up[e, 48:]
            legacy[f"{pre}block_sparse_moe.experts.{e}.w2.weight"] = down[e]
    from_legacy = hf_to_neox_state_dict(legacy, cfg, arch)
    assert set(from_legacy) == set(ours.state_dict())
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in from_legacy.items())


def test_exports_that_mixtral_cannot_represent_are_refused() -> None:
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        padded_vocab_size=VOCAB,
        max_position_embeddings=64,
        pos_emb="rotary",
        norm="rmsnorm",
        activation="swiglu",
        use_bias_in_attn_linear=False,
        use_bias_in_mlp=False,
        moe_num_experts=4,
    )
    sinkhorn = GPTModelConfig(**base)
    with pytest.raises(ValueError, match="no exact MixtralForCausalLM equivalent: moe_router_type='sinkhorn'"):
        neox_to_hf_config(sinkhorn, "mixtral")
    with pytest.raises(ValueError, match="mixture-of-experts layers \\(moe_num_experts=4; llama is dense\\)"):
        neox_to_hf_config(sinkhorn, "llama")
    every_other = GPTModelConfig(
        **base, moe_router_type="topk", moe_normalize_expert_weights=True, moe_expert_interval=2
    )
    with pytest.raises(ValueError, match="moe_expert_interval=2"):
        neox_to_hf_config(every_other, "mixtral")


def test_mixtral_folder_through_the_converters_at_tp2(tmp_path: Path) -> None:
    """HF Mixtral → NeoX (tp=2, pp=1; experts split over the TP ranks) → HF: same tensors and logits; resharded
    to tp=1 the checkpoint exports the same tensors."""
    from megatron.neox_arguments import NeoXArgs
    from tests.unit.test_ckpt_hf import RESHARD, TO_HF, TO_NEOX, _disk_tensors, _hf_model, _run, _tokenizer

    original = _hf_model(_mixtral(vocab_size=128), tmp_path / "hf")
    _tokenizer(tmp_path / "hf")
    neox, back = tmp_path / "neox", tmp_path / "back"
    assert (
        _run(TO_NEOX, ["--input_dir", str(tmp_path / "hf"), "--output_dir", str(neox), "--tp", "2", "--pp", "1"]) == 0
    )
    shard = torch.load(neox / "global_step0" / "layer_02-model_01-model_states.pt", weights_only=True)
    assert shard["mlp.experts.mlp.w1"].shape == (2 * 48, 64)  # experts 2 and 3 on TP rank 1
    setup = tmp_path / "setup.yml"
    setup.write_text("seq_length: 16\nglobal_num_gpus: 2\ntrain_micro_batch_size_per_gpu: 2\ntrain_iters: 1\n")
    args = NeoXArgs.from_ymls([str(neox / "neox_config.yml"), str(neox / "tokenizer.yml"), str(setup)])
    assert (args.moe_num_experts, args.moe_top_k, args.moe_router_type) == (4, 2, "topk")
    assert args.moe_normalize_expert_weights is True
    step = str(neox / "global_step0")
    assert _run(TO_HF, ["--input_dir", step, "--output_dir", str(back), "--architecture", "mixtral"]) == 0
    src, dst = _disk_tensors(tmp_path / "hf"), _disk_tensors(back)
    assert set(dst) == set(src) and all(torch.equal(dst[k], v) for k, v in src.items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)

    flat, back2 = tmp_path / "flat", tmp_path / "back2"
    assert _run(RESHARD, ["--input_dir", str(neox), "--output_dir", str(flat), "--tp", "1", "--pp", "0"]) == 0
    assert _run(TO_HF, ["--input_dir", str(flat), "--output_dir", str(back2), "--architecture", "mixtral"]) == 0
    assert all(torch.equal(t, src[k]) for k, t in _disk_tensors(back2).items())
