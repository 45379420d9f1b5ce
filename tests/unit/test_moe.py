"""Mixture of experts: routers, dropless dispatch, the layer against a dense per-expert loop (values and gradients,
aux loss included), placement, activation checkpointing and config validation."""

from __future__ import annotations

import pytest
import torch

from megatron.model import GPTModelConfig, build_sequential_model, cross_entropy
from megatron.model.moe import ParallelDroplessMoE, moe_layers, moe_metrics, with_aux_loss
from megatron.model.moe.aux_loss import reset_loss_grad
from megatron.model.moe.router import sinkhorn
from tests.unit.test_model import V
from tests.unit.test_model import tiny as dense_tiny

H = 32


def tiny(**kw) -> GPTModelConfig:
    """``tests.unit.test_model.tiny`` (hidden 32, vocab 128) as a one-layer MoE model with 4 top-2 experts."""
    moe = dict(num_layers=1, intermediate_size=48, moe_num_experts=4, moe_top_k=2, moe_router_type="topk")
    return dense_tiny(**{**moe, "moe_loss_weight": 0.3, **kw})


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within 1e-5 (relative to the reference's magnitude when it exceeds 1)."""
    return bool((a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max())))


def build_layer(cfg: GPTModelConfig) -> ParallelDroplessMoE:
    init = torch.nn.init.normal_
    torch.manual_seed(3)
    return ParallelDroplessMoE(cfg, 0, lambda w: init(w, std=0.1), lambda w: init(w, std=0.1))


def reference(layer: ParallelDroplessMoE, x: torch.Tensor, params: dict[str, torch.Tensor], cfg: GPTModelConfig):
    """Dense loop over tokens and their experts with plain tensors: (output [T, h], aux loss)."""
    ffn, k, num_experts = cfg.moe_ffn_size, cfg.moe_top_k, cfg.moe_num_experts
    logits = x @ params["router"].t()
    probs = torch.softmax(logits, dim=-1)
    if cfg.moe_router_type == "topk":
        weights, idx = torch.topk(probs, k, dim=-1)
    else:
        act = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, dim=-1)
        _, idx = torch.topk(sinkhorn(logits.detach()), k, dim=-1)
        weights = torch.gather(act, 1, idx)
    act_fn = layer.experts.mlp.activation
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for j in range(k):
            e = int(idx[t, j])
            sl = slice(e * ffn, (e + 1) * ffn)
            a = act_fn(params["w1"][sl] @ x[t])
            if "w3" in params:
                a = a * (params["w3"][sl] @ x[t])
            acc = acc + weights[t, j] * (a @ params["w2"][sl])
        rows.append(acc)
    counts = torch.bincount(idx.reshape(-1), minlength=num_experts).float()
    aux = num_experts * torch.sum(counts / (x.shape[0] * k) * probs.mean(0))
    return torch.stack(rows), aux


@pytest.mark.parametrize(
    "router,top_k,activation,gated",
    [
        ("topk", 2, "gelu", False),
        ("topk", 1, "swiglu", True),
        ("topk", 2, "swiglu", False),
        ("sinkhorn", 1, "gelu", False),
        ("sinkhorn", 2, "swiglu", True),
        ("sinkhorn", 1, "geglu", False),
    ],
)
def test_layer_equals_dense_expert_loop_values_and_grads(router: str, top_k: int, activation: str, gated: bool) -> None:
    """Gated activations without ``moe_gated_experts`` apply their function (SiLU, GELU) ungated, as GPT-NeoX."""
    cfg = tiny(moe_router_type=router, moe_top_k=top_k, activation=activation, moe_gated_experts=gated)
    layer = build_layer(cfg).train()
    x = torch.randn(5, 3, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad_out = torch.randn(5, 3, H, generator=torch.Generator().manual_seed(2))
    reset_loss_grad()
    out, bias = layer(x)
    assert bias is None
    (out * grad_out).sum().backward()  # the layer injects moe_loss_weight × d(aux) itself

    mlp = layer.experts.mlp
    names = {"router": layer.router.layer.weight, "w1": mlp.w1, "w2": mlp.w2}
    assert hasattr(mlp, "w3") is gated
    if cfg.moe_experts_gated:
        names["w3"] = mlp.w3
    params = {n: p.detach().clone().requires_grad_(True) for n, p in names.items()}
    x_ref = x.detach().clone().requires_grad_(True)
    ref_out, ref_aux = reference(layer, x_ref.reshape(-1, H), params, cfg)
    ((ref_out.reshape(5, 3, H) * grad_out).sum() + cfg.moe_loss_weight * ref_aux).backward()

    assert (out - ref_out.reshape(5, 3, H)).abs().max() <= 1e-5
    assert abs(float(layer.last_aux_loss) - float(ref_aux.detach())) <= 1e-5
    assert close(x.grad, x_ref.grad)
    for n, p in names.items():
        assert close(p.grad, params[n].grad), n


def test_dropless_every_token_reaches_exactly_its_top_k_experts() -> None:
    """A router sending every token to expert 0 would overflow any capacity: nothing is dropped."""
    cfg = tiny(moe_top_k=1, moe_loss_weight=0.0)
    layer = build_layer(cfg).eval()
    with torch.no_grad():
        layer.router.layer.weight.zero_()
        layer.router.layer.weight[0] = 1.0
    x = torch.rand(16, 2, H) + 0.1  # positive: expert 0 wins for every token
    out, _ = layer(x)
    assert layer.last_tokens_per_expert.tolist() == [32, 0, 0, 0]
    mlp = layer.experts.mlp
    expected = mlp.expert(0, x.reshape(-1, H)) * torch.softmax(layer.router.layer(x.reshape(-1, H)), -1)[:, :1]
    assert (out.reshape(-1, H) - expected).abs().max() <= 1e-5

    # Random routing, top-2: each token's output is exactly the weighted sum over its two distinct experts.
    cfg2 = tiny(moe_top_k=2)
    layer2 = build_layer(cfg2).eval()
    x2 = torch.randn(9, 2, H, generator=torch.Generator().manual_seed(4))
    out2, _ = layer2(x2)
    weights, idx, _ = layer2.router(x2.reshape(-1, H))
    assert layer2.last_tokens_per_expert.sum() == 18 * 2
    assert (idx[:, 0] != idx[:, 1]).all()
    for t in range(18):
        want = sum(
            weights[t, j] * layer2.experts.mlp.expert(int(idx[t, j]), x2.reshape(-1, H)[t : t + 1])[0] for j in range(2)
        )
        assert (out2.reshape(-1, H)[t] - want).abs().max() <= 1e-5


def test_sinkhorn_balances_a_skewed_router_and_eval_uses_plain_top_k() -> None:
    logits = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    logits[:, 0] += 3.0  # argmax would send almost everything to expert 0
    plain = torch.bincount(logits.argmax(-1), minlength=4)
    balanced = torch.bincount(sinkhorn(logits).argmax(-1), minlength=4)
    assert plain.max() > 50 and balanced.max() < plain.max() / 2
    layer = build_layer(tiny(moe_router_type="sinkhorn", moe_top_k=1)).eval()
    x = torch.randn(10, H)
    weights, idx, _ = layer.router(x)
    expect_w, expect_i = torch.topk(torch.sigmoid(layer.router.layer(x)), 1, dim=-1)
    assert torch.equal(idx, expect_i) and torch.allclose(weights, expect_w)


def test_topk_jitter_only_in_training() -> None:
    layer = build_layer(tiny(moe_jitter_eps=0.5))
    x = torch.randn(50, H, generator=torch.Generator().manual_seed(5))
    _, _, p_eval = layer.eval().router(x)
    torch.manual_seed(0)
    _, _, p_train = layer.train().router(x)
    assert torch.allclose(p_eval, torch.softmax(layer.router.layer(x), -1))
    assert not torch.allclose(p_train, p_eval)


def test_placement_every_interval_from_layer_zero_and_names() -> None:
    cfg = tiny(num_layers=4, moe_expert_interval=2)
    model = build_sequential_model(cfg)
    assert [m.layer_index for m in moe_layers(model)] == [0, 2]
    names = {n for n, _ in model.named_parameters()}
    assert {"sequential.2.mlp.router.layer.weight", "sequential.2.mlp.experts.mlp.w1"} <= names
    assert "sequential.3.mlp.linear1.weight" in names and "sequential.4.mlp.experts.mlp.w2" in names
    assert model.sequential[2].mlp.experts.mlp.w1.shape == (4 * 48, H)


def test_checkpointing_and_loss_scale_keep_moe_grads_exact() -> None:
    """The aux-loss gradient is injected in backward, so recomputation and a scaled loss (DeepSpeed's 1/gas, the
    fp16 loss scale) give the same gradients as the plain ``lm + w·aux`` loss."""
    cfg = tiny(num_layers=2, hidden_dropout=0.0)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(7))
    targets = (torch.roll(ids, -1, 1), torch.ones(ids.shape))
    runs = []
    for ckpt, scale in ((False, 1.0), (True, 1.0), (False, 4.0)):
        model = build_sequential_model(cfg.replace(checkpoint_activations=ckpt)).train()
        loss = with_aux_loss(cross_entropy, model)(model(ids), targets)
        (loss * scale).backward()
        runs.append((loss.detach(), {k: p.grad / scale for k, p in model.named_parameters()}))
    stats = moe_metrics(model)
    assert stats["train/moe_aux_loss"] > 0.9 and "moe/layer_01/tokens_expert_3" in stats
    for loss, grads in runs[1:]:
        assert torch.equal(loss, runs[0][0])
        for key, grad in grads.items():
            assert torch.allclose(grad, runs[0][1][key], atol=1e-6, rtol=0), key
    router_grad = runs[0][1]["sequential.2.mlp.router.layer.weight"]
    assert router_grad.abs().sum() > 0


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(moe_top_k=5), "moe_top_k=5 must be an int in [1, moe_num_experts=4]"),
        (dict(moe_router_type="expert_choice"), "moe_router_type='expert_choice' is not one of sinkhorn, topk"),
        (dict(moe_expert_interval=0), "moe_expert_interval=0 must be an int >= 1"),
        (dict(moe_jitter_eps=1.5), "moe_jitter_eps=1.5 must be in [0, 1)"),
        (dict(moe_router_type="sinkhorn", moe_jitter_eps=0.1), "applies to moe_router_type: topk only"),
        (dict(moe_loss_weight=-1.0), "moe_loss_weight=-1.0 must be >= 0"),
        (dict(sequence_parallel=True), "cannot be combined with sequence_parallel"),
        (dict(moe_num_experts=0), "moe_num_experts=0 must be an int >= 1"),
        (dict(moe_gated_experts=True), "moe_gated_experts needs a gated activation (geglu, *), got 'gelu'"),
        (dict(moe_gated_experts=True, moe_num_experts=1, activation="swiglu"), "applies to MoE models only"),
    ],
)
def test_invalid_moe_config_is_refused_with_the_key(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=".*".join(map(__import__("re").escape, message.split("*")))):
        tiny(**change)


def test_moe_gated_experts_is_checked_by_the_config_too() -> None:
    from megatron.neox_arguments import ConfigError, LaunchEnv, NeoXArgs

    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "moe_gated_experts": True}
    base.update(max_position_embeddings=32, train_micro_batch_size_per_gpu=2, moe_num_experts=4)
    with pytest.raises(ConfigError, match="moe_gated_experts needs a gated activation"):
        NeoXArgs(base, env=LaunchEnv(world_size=1, on_cpu=True))
    assert NeoXArgs({**base, "activation": "geglu"}, env=LaunchEnv(world_size=1, on_cpu=True)).moe_gated_experts


def test_tp_sharding_splits_whole_experts_and_merges_back() -> None:
    from megatron.model.tp_sharding import merge_state_dicts, partition_spec, shard_state_dict

    cfg = tiny(num_layers=2, activation="swiglu", moe_gated_experts=True)
    full = build_sequential_model(cfg).state_dict()
    assert partition_spec("sequential.2.mlp.experts.mlp.w3", cfg) == (0, None)
    assert partition_spec("sequential.2.mlp.router.layer.weight", cfg) == (None, None)
    shards = [shard_state_dict(full, cfg, r, 2) for r in range(2)]
    f = cfg.moe_ffn_size
    w1 = full["sequential.2.mlp.experts.mlp.w1"]
    assert torch.equal(shards[1]["sequential.2.mlp.experts.mlp.w1"], w1[2 * f :])  # experts 2 and 3
    merged = merge_state_dicts(shards, cfg)
    assert all(torch.equal(merged[k], v) for k, v in full.items())
