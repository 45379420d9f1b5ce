"""Mamba layers: the chunked selective scan against mamba_ssm's reference and a sequential loop, the one-token step,
GPT-NeoX's parameter names and init, the kernel choice, and cached decoding against the full forward."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from megatron.model import GPTModelConfig, KVCache, build_sequential_model
from megatron.model.mamba import selective_scan, selective_state_step
from megatron.model.mamba.kernels import _LOGGED
from megatron.model.weight_decay import no_weight_decay_names

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "mamba_ssm" / "selective_scan_ref.pt"
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
V = 128


def sequential_scan(u, delta, A, B, C, D, z, delta_bias, state=None):
    """The recurrence token by token (test reference): out [b, d, l] and the last state."""
    dt = torch.nn.functional.softplus(delta + delta_bias[:, None])
    h = state.clone() if state is not None else u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[-1]):
        h = torch.exp(dt[..., t, None] * A) * h + (dt[..., t] * u[..., t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1) + u * D[:, None]
    return y * torch.nn.functional.silu(z), h


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_scan_equals_mamba_ssm_reference(chunk: int) -> None:
    """Forward, last state and every input gradient equal mamba_ssm's ``selective_scan_ref`` (fixture)."""
    fix = torch.load(FIXTURE, weights_only=True)
    leaf = {k: fix[f"input.{k}"].clone().requires_grad_(True) for k in NAMES}
    out, last = selective_scan(**leaf, delta_softplus=True, chunk_size=chunk)
    ((out * fix["grad_out"]).sum() + (last * fix["grad_last_state"]).sum()).backward()
    torch.testing.assert_close(out, fix["out"], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(last, fix["last_state"], atol=2e-5, rtol=1e-4)
    for k in NAMES:
        torch.testing.assert_close(leaf[k].grad, fix[f"grad.{k}"], atol=5e-5, rtol=1e-4, msg=k)


def _inputs(b: int, d: int, length: int, n: int, seed: int, delta_scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "u": r(b, d, length),
        "delta": r(b, d, length) * delta_scale,
        "A": -torch.exp(r(d, n)),
        "B": r(b, n, length),
        "C": r(b, n, length),
        "D": r(d),
        "z": r(b, d, length),
        "delta_bias": r(d),
    }


def test_chunked_scan_equals_sequential_loop_with_initial_state_and_strong_decay() -> None:
    """A long sequence with large Δ·A (a cumulative log-decay of thousands: no overflow) from a given state."""
    x = _inputs(2, 6, 203, 16, seed=5, delta_scale=3.0)
    state = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(6))
    want, want_last = sequential_scan(**x, state=state)
    assert (torch.nn.functional.softplus(x["delta"] + x["delta_bias"][:, None]) * x["A"].min()).sum(-1).min() < -500
    got, last = selective_scan(**x, delta_softplus=True, initial_state=state, chunk_size=16)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last, want_last, atol=1e-4, rtol=1e-4)


def test_segmented_scan_gradients_equal_the_loop_across_segments() -> None:
    """150 tokens: three segments of the scan (the last one short); every input gradient, the start state's and the
    last state's included, equals autograd through the token-by-token loop."""
    x = {k: v.double() for k, v in _inputs(2, 5, 150, 4, seed=9).items()}
    state = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    g_out, g_last = torch.randn(2, 5, 150, generator=g, dtype=torch.float64), torch.randn(2, 5, 4, generator=g)

    def grads(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], **kw: object) -> list[torch.Tensor]:
        leaves = {k: v.clone().requires_grad_(True) for k, v in {**x, "state": state}.items()}
        out, last = fn(**{k: v for k, v in leaves.items() if k != "state"}, **kw, **{
            "initial_state" if fn is selective_scan else "state": leaves["state"]})  # fmt: skip
        ((out.double() * g_out).sum() + (last.double() * g_last.double()).sum()).backward()
        return [out.double(), last.double(), *(leaves[k].grad for k in leaves)]

    ours, loop = grads(selective_scan, delta_softplus=True), grads(sequential_scan)
    for a, b in zip(ours, loop, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_step_function_continues_the_scan() -> None:
    """Scanning a prefix, then one ``selective_state_step`` per token, equals scanning everything."""
    x = _inputs(2, 4, 12, 8, seed=7)
    full, full_last = selective_scan(**x, delta_softplus=True)
    _, state = selective_scan(**{k: v[..., :7] if v.dim() == 3 else v for k, v in x.items()}, delta_softplus=True)
    for t in range(7, 12):
        step = {k: v[..., t] if v.dim() == 3 else v for k, v in x.items()}
        y, state = selective_state_step(state, **step, delta_softplus=True)
        torch.testing.assert_close(y, full[..., t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, full_last, atol=1e-5, rtol=1e-5)


def _cfg(**kw) -> GPTModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=V,
        max_position_embeddings=64,
        attention_config=[[["mamba"], 2]],
        norm="rmsnorm",
        pos_emb="none",
        init_method="small_init",
        output_layer_init_method="single_residual_scaled_normal",
        seed=3,
    )
    base.update(kw)
    return GPTModelConfig(**base)


def test_parameter_names_shapes_and_bias_keys_are_gpt_neox() -> None:
    shapes = {n: tuple(p.shape) for n, p in build_sequential_model(_cfg()).named_parameters()}
    layer = {n[len("sequential.2.") :]: s for n, s in shapes.items() if n.startswith("sequential.2.")}
    # h 32, d_inner 2h = 64, dt_rank ceil(32/16) = 2, d_state 16, conv width 4; conv bias on, linear biases off
    assert layer == {
        "norm.scale": (32,),
        "mixer.A_log": (64, 16),
        "mixer.D": (64,),
        "mixer.in_proj.weight": (128, 32),
        "mixer.conv1d.weight": (64, 1, 4),
        "mixer.conv1d.bias": (64,),
        "mixer.x_proj.weight": (34, 64),
        "mixer.dt_proj.weight": (64, 2),
        "mixer.dt_proj.bias": (64,),
        "mixer.out_proj.weight": (32, 64),
    }
    assert "sequential.3.mixer.A_log" in shapes and "sequential.5.norm.scale" in shapes
    flipped = build_sequential_model(
        _cfg(mamba_use_bias_in_conv=False, mamba_use_bias_in_linears=True, expansion_factor=3)
    )
    names = {n[len("sequential.2.mixer.") :]: tuple(p.shape) for n, p in flipped.named_parameters() if ".2.mixer." in n}
    assert "conv1d.bias" not in names
    assert (names["in_proj.bias"], names["x_proj.bias"], names["out_proj.bias"]) == ((192,), (34,), (32,))
    assert names["A_log"] == (96, 16)
    assert tuple(build_sequential_model(_cfg(intermediate_size=48)).sequential[2].mixer.D.shape) == (48,)


def test_init_follows_gpt_neox() -> None:
    model = build_sequential_model(_cfg(hidden_size=64, num_layers=4, attention_config=[[["mamba"], 4]]))
    mixer = model.sequential[2].mixer
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1, 17.0)).expand(128, 16))
    assert torch.equal(mixer.D, torch.ones(128))
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001 and dt.std() > 0.01
    assert mixer.dt_proj.weight.abs().max() <= 4**-0.5  # uniform(±dt_rank^-1/2), dt_rank 4
    assert mixer.conv1d.weight.abs().max() <= 0.5 and mixer.conv1d.weight.std() > 0.2  # uniform(±1/√4)
    small = math.sqrt(2 / (5 * 64))  # small_init
    assert abs(mixer.in_proj.weight.std().item() / small - 1) < 0.05
    scaled = 0.02 / math.sqrt(4)  # single_residual_scaled_normal: σ/√L
    assert abs(mixer.out_proj.weight.std().item() / scaled - 1) < 0.05
    decay_free = no_weight_decay_names(model)
    assert {"sequential.2.mixer.A_log", "sequential.2.mixer.D", "sequential.2.mixer.dt_proj.bias"} <= decay_free
    assert "sequential.2.mixer.in_proj.weight" not in decay_free


def test_kernel_choice_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """mamba_ssm / causal_conv1d are not installed here: the fusion keys fall back to the PyTorch path, said once."""
    _LOGGED.clear()
    model = build_sequential_model(_cfg(mamba_selective_scan_fusion=True, mamba_inner_func_fusion=False))
    ids = torch.randint(0, V, (1, 8))
    with caplog.at_level(logging.INFO, logger="megatron.model.mamba.kernels"):
        model(ids)
        model(ids)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "Mamba selective scan: the PyTorch path (mamba_selective_scan_fusion is set, but its package is not installed)",
        "Mamba causal conv1d: the PyTorch path (mamba_causal_conv_fusion is off)",
    ]


def test_inner_fusion_with_linear_biases_is_refused() -> None:
    with pytest.raises(ValueError, match="mamba_inner_func_fusion and mamba_use_bias_in_linears"):
        _cfg(mamba_inner_func_fusion=True, mamba_use_bias_in_linears=True)


@pytest.mark.parametrize("kinds", [[[["mamba"], 2]], [[["mamba", "global"], 1]]])
def test_cached_decoding_equals_full_forward(kinds: list) -> None:
    """Prefix once, then one token per forward (the recurrent state in the cache, no re-run of the prefix): the
    logits equal those of one forward over the whole sequence; also for a mixed Mamba + attention model."""
    model = build_sequential_model(_cfg(attention_config=kinds, pos_emb="rotary")).eval()
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        parts = [model(ids[:, :6], kv_cache=cache)]
        parts.append(model(ids[:, 6:9], kv_cache=cache))  # several tokens on top of a state (chunked scan)
        for t in range(9, 13):
            parts.append(model(ids[:, t : t + 1], kv_cache=cache))  # one step per token
    assert cache.seq_len == 13 and set(cache.layer_states) == {i for i in (0, 1) if model.cfg.layer_types[i] == "mamba"}
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_generation_with_the_recurrent_state_equals_recomputation() -> None:
    """The generation loop (prompts of different lengths in one batch): with the cache each step feeds one token;
    its per-step logits and greedy tokens equal those of re-running the whole context every step."""
    from megatron.generation.sampling import SamplingConfig, generate_tokens_batch, kv_cache_forward

    model = build_sequential_model(_cfg(attention_config=[[["mamba", "global"], 1]], pos_emb="rotary")).eval()
    prompts = [[5, 9, 2, 77, 31], [8, 3]]
    runs = {}
    for recompute in (False, True):
        cfg = SamplingConfig(temperature=0.0, top_k=0, top_p=0.0, maximum_tokens=6, seq_length=64, recompute=recompute)
        logits: list[list[torch.Tensor]] = [[], []]
        out = generate_tokens_batch(kv_cache_forward(model), prompts, cfg, eod_token=0, logits_out=logits)
        runs[recompute] = (out, logits)
    (cached, cached_logits), (full, full_logits) = runs[False], runs[True]
    assert cached == full and all(len(tokens) == 6 for tokens, _ in cached)
    for a, b in zip(cached_logits, full_logits, strict=True):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), atol=1e-5, rtol=1e-5)


def test_flops_count_mamba_layers_with_gpt_neox_formula() -> None:
    """All-Mamba: GPT-NeoX's logged formula (mamba-130M's shape); mixed: Mamba and transformer layers each their own."""
    from megatron.logging.flops import FlopsConfig, flops_per_iteration

    b, s, h, v, layers = 8, 2048, 768, 50304, 24
    shape = dict(train_batch_size=b, seq_length=s, num_layers=layers, hidden_size=h, padded_vocab_size=v)
    shape["num_attention_heads"] = 12
    for k, ckpt in ((3, False), (4, True)):
        cfg = FlopsConfig(**shape, checkpoint_activations=ckpt, attention_config=["mamba"] * layers)
        d, r = 2 * h, 48  # inner width 2h, dt_rank ceil(768/16)
        ssm, proj, conv = k * d * s * b * (11 * 16 + 4 * r + 1), k * s * b * 6 * d * h, k * s * b * 2 * d * 4
        assert flops_per_iteration(cfg, k) == pytest.approx((ssm + proj + conv) * layers + 6 * s * b * h * v)
    mixed = FlopsConfig(**shape, attention_config=["mamba", "global"] * 12, expansion_factor=3.0)
    d = 3 * h
    mamba = 3 * b * s * (d * (11 * 16 + 4 * 48 + 1) + 6 * d * h + 2 * d * 4)
    attention = 24 * 3 * b * s * h * h * (1 + s / (6 * h))
    assert flops_per_iteration(mixed, 3) == pytest.approx(12 * mamba + 12 * attention + 1.5 * 3 * b * s * h * v)
    plain = FlopsConfig(**shape)
    assert flops_per_iteration(plain, 3) == pytest.approx(
        24 * 3 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    )


def test_planner_plans_mamba(capsys: pytest.CaptureFixture[str]) -> None:
    import deepy

    argv = [
        "--plan",
        "train.py",
        "configs/cpu/tiny.yml",
        "--vocab-size",
        "512",
        "--attention_config",
        '[[["mamba"], 2]]',
    ]
    assert deepy.main(argv) == 0  # counted by megatron/planner/families.py (tests/unit/test_planner_families.py)
    out = capsys.readouterr().out
    assert "GPT-NeoX's Mamba formula" in out and "activations/layer 4·(12·b·s·d" in out


def test_hf_export_refuses_mamba_layers() -> None:
    from megatron.model.hf_mapping import neox_to_hf_config

    with pytest.raises(ValueError, match="attention_config 'mamba' layers"):
        neox_to_hf_config(_cfg(pos_emb="rotary"), "neox")


def test_config_rules_for_mamba_layers() -> None:
    """Mamba configs: inner width divisible by TP, a pipeline partition that counts Mamba layers."""
    from tests.unit.test_neox_args import build, problems

    mamba = {"attention_config": [[["mamba"], 2]]}
    assert build(**mamba, hidden_size=66, num_attention_heads=4).attention_config == ["mamba", "mamba"]
    assert "Mamba's inner width intermediate_size=66" in " ".join(
        problems(**mamba, intermediate_size=66, model_parallel_size=4)
    )
    pipe = problems(**mamba, pipe_parallel_size=2, global_num_gpus=2)
    assert any("matches no layer of this all-Mamba model" in p for p in pipe), pipe
    ok = build(
        **mamba, pipe_parallel_size=2, global_num_gpus=2, pipe_partition_method="type:transformerlayer|mlp|mamba"
    )
    assert ok.pipe_parallel_size == 2
