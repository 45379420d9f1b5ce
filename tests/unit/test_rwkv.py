"""RWKV-6 (``attention_config`` type ``rwkv``): the chunked WKV operator against the plain recurrence, and the block
against GPT-NeoX's own code (``tests/fixtures/gpt-neox/rwkv_block.json``: its ``rwkv.py`` run on the CPU with its
CUDA kernel transcribed line by line; see the fixtures' README)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.kv_cache import KVCache
from megatron.model.rwkv import RWKVResidualLayer
from megatron.model.rwkv.wkv import LOG_DECAY_FLOOR, wkv_chunked, wkv_step
from megatron.neox_arguments import ConfigError, LaunchEnv, NeoXArgs

FIXTURE = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "gpt-neox" / "rwkv_block.json").read_text())


def naive_wkv(r, k, v, w, u, state=None):
    """The recurrence token by token, exactly as the kernel states it (no floor on the decay)."""
    b, t, h, n = r.shape
    s = torch.zeros(b, h, n, n, dtype=r.dtype) if state is None else state.to(r.dtype)
    ys = []
    for i in range(t):
        kv = k[:, i, :, :, None] * v[:, i, :, None, :]
        ys.append((r[:, i, :, :, None] * (u[None, :, :, None] * kv + s)).sum(-2))
        s = torch.exp(-torch.exp(w[:, i]))[..., None] * s + kv
    return torch.stack(ys, 1), s


def _inputs(b, t, h, n, scale=1.0, shift=0.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(b, t, h, n, generator=g, dtype=dtype) for _ in range(3))
    w = torch.randn(b, t, h, n, generator=g, dtype=dtype) * scale + shift
    u = torch.randn(h, n, generator=g, dtype=dtype)
    return r, k, v, w, u


@pytest.mark.parametrize("chunk", [1, 3, 16, 37, 64])
def test_chunked_wkv_equals_the_recurrence_forward_and_gradients(chunk: int) -> None:
    r, k, v, w, u = (x.requires_grad_() for x in _inputs(2, 37, 3, 8))
    s0 = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    gy = torch.randn(2, 37, 3, 8, dtype=torch.float64)
    y_ref, s_ref = naive_wkv(r, k, v, w, u, s0)
    grads_ref = torch.autograd.grad((y_ref * gy).sum() + s_ref.sum(), (r, k, v, w, u))
    y, s = wkv_chunked(r, k, v, w, u, s0, chunk=chunk)
    grads = torch.autograd.grad((y * gy).sum() + s.sum(), (r, k, v, w, u))
    scale = y_ref.abs().max()
    assert (y - y_ref).abs().max() / scale < 1e-12  # fp64 in, fp64 arithmetic
    assert (s - s_ref).abs().max() / s_ref.abs().max() < 1e-12
    for name, g, g_ref in zip("rkvwu", grads, grads_ref, strict=True):
        assert (g - g_ref).abs().max() / g_ref.abs().max() < 1e-12, name


@pytest.mark.parametrize(("scale", "shift"), [(4.0, 3.0), (1.0, -8.0), (0.5, -1.0)])
def test_long_fp32_sequences_with_extreme_decays_stay_exact(scale: float, shift: float) -> None:
    """512 fp32 tokens: decays from exp(-exp(w)) with exp(w) in the thousands (strong; the floor at e^-30 applies)
    to ~3e-4 per token (weak: the chunk's log-decay sums cancel), compared with the fp64 recurrence."""
    r, k, v, w, u = _inputs(1, 512, 2, 8, scale, shift, seed=1)
    y_ref, _ = naive_wkv(r, k, v, w, u)
    for chunk in (16, 64):
        y, _ = wkv_chunked(*(x.float() for x in (r, k, v, w, u)), chunk=chunk)
        assert torch.isfinite(y).all()
        assert ((y.double() - y_ref).abs().max() / y_ref.abs().max()).item() < 1e-4, chunk


def test_the_factored_chunk_form_overflows_where_the_pairwise_one_does_not() -> None:
    """Why the chunk's decays are taken pairwise: ``(r e^{a}) (k e^{-a})ᵀ`` needs e^{-a} of the whole chunk's
    log-decay, which passes fp32's e^88 within 16 tokens of a moderately strong decay (exp(w) = 7.4 per token)."""
    r, k, v, _, u = (x.float() for x in _inputs(1, 16, 1, 4, seed=2))
    w = torch.full_like(r, 2.0)
    a = torch.cumsum(-torch.exp(w), dim=1)
    assert not torch.isfinite(k * torch.exp(-a)).all()  # the factored form's key factor
    y, _ = wkv_chunked(r, k, v, w, u, chunk=16)
    y_ref, _ = naive_wkv(*(x.double() for x in (r, k, v, w, u)))
    assert torch.isfinite(y).all() and torch.allclose(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    assert LOG_DECAY_FLOOR == -30.0


def test_one_step_equals_the_chunked_form_and_carries_state() -> None:
    r, k, v, w, u = (x.float() for x in _inputs(2, 10, 2, 4, seed=3))
    y_full, s_full = wkv_chunked(r, k, v, w, u)
    state = torch.zeros(2, 2, 4, 4)
    ys = []
    for t in range(10):
        y, state = wkv_step(r[:, t], k[:, t], v[:, t], w[:, t], u, state)
        ys.append(y)
    assert torch.allclose(torch.stack(ys, 1), y_full, atol=1e-5) and torch.allclose(state, s_full, atol=1e-5)


def test_the_operator_equals_gpt_neox_s_kernel() -> None:
    """Forward and the kernel's own backward (``kernel_backward_111``/``222``, fp32) of GPT-NeoX's ``wkv6_cuda.cu``."""
    op = FIXTURE["op"]
    b, t, h, n = op["B"], op["T"], op["H"], op["N"]
    leaves = {x: torch.tensor(op[x]).requires_grad_() for x in "rkvwu"}
    r, k, v, w = (leaves[x].view(b, t, h, n) for x in "rkvw")
    y, _ = wkv_chunked(r, k, v, w, leaves["u"], chunk=4)
    y.reshape(b, t, h * n).backward(torch.tensor(op["gy"]))
    assert torch.allclose(y.reshape(b, t, h * n), torch.tensor(op["y"]), atol=2e-5)
    for x in "rkvwu":
        assert torch.allclose(leaves[x].grad, torch.tensor(op[f"grad_{x}"]), atol=5e-5), x


def _cfg(**more) -> GPTModelConfig:
    c = FIXTURE["config"]
    values = dict(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"]
    )
    values.update(padded_vocab_size=64, max_position_embeddings=64, attention_config=[[["rwkv"], c["num_layers"]]])
    return GPTModelConfig(**{**values, **more})


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _probes(t: torch.Tensor, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    probes = torch.randn(3, *t.shape, generator=g, dtype=torch.float64)
    return [float((probes[i] * t.double()).sum()) for i in range(3)]


def _assert_within_an_ulp_of_the_formula(name: str, p: torch.Tensor, layer: int) -> None:
    """The time_maa_* tables are fp32 ``pow`` of GPT-NeoX's formula. CPUs' vector ``pow`` kernels may round them
    one ulp apart (``pow(x, 0.5)`` on this project's AVX-512 Xeon differs from the machine the fixture was made on),
    so a table whose bytes differ must be the formula, computed in float64, to within one fp32 ulp; any other
    tensor (random draws: names, shapes, draw order) must match bit for bit."""
    mixes = {"x": 1.0, "w": 1.0, "k": 1.0, "v": 1.0, "r": 0.5, "g": 0.5}
    key = name.removeprefix("att.time_maa_")
    assert name.startswith("att.time_maa_") and key in mixes, f"{name}: bytes differ from GPT-NeoX's"
    layers = FIXTURE["config"]["num_layers"]
    h = p.shape[-1]
    ddd = torch.arange(h, dtype=torch.float64) / h
    expect = 1.0 - ddd ** (mixes[key] * (1.0 - layer / layers))
    if key == "v":
        expect = expect - 0.3 * layer / (layers - 1)
    assert torch.allclose(p.double().flatten(), expect, rtol=0, atol=2.0**-24 * 2), name


@pytest.mark.parametrize("case", FIXTURE["blocks"], ids=lambda c: f"layer{c['layer']}")
def test_the_block_equals_gpt_neox_s(case: dict) -> None:
    """Same seed → the same tensors bit for bit (names, shapes, init, draw order); then output and gradients."""
    torch.manual_seed(case["seed"])
    block = RWKVResidualLayer(_cfg(), case["layer"])
    state = block.state_dict()
    assert set(state) == set(case["init_sha256"])
    for name, p in state.items():
        if _sha(p) != case["init_sha256"][name]:
            _assert_within_an_ulp_of_the_formula(name, p, case["layer"])
    x = torch.tensor(case["x"]).requires_grad_()
    y = block(x)
    y.backward(torch.tensor(case["gy"]))
    assert torch.allclose(y, torch.tensor(case["y"]), atol=1e-5)
    assert torch.allclose(x.grad, torch.tensor(case["grad_x"]), atol=1e-5)
    for name, p in block.named_parameters():
        assert p.grad is not None
        assert p.grad.double().norm().item() == pytest.approx(case["grad_norms"][name], rel=1e-4, abs=1e-7), name
        assert _probes(p.grad, 7) == pytest.approx(case["grad_probes"][name], rel=1e-4, abs=1e-6), name


def test_generation_with_the_recurrent_state_equals_the_full_sequence() -> None:
    """A prompt (chunked, state carried out), then one token at a time (per-token step): the logits of a forward
    over the whole sequence, in a model that mixes rwkv and attention layers."""
    cfg = _cfg(num_layers=3, attention_config=[[["rwkv", "global", "rwkv"], 1]], no_weight_tying=True)
    model = build_sequential_model(cfg).eval()
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        parts = [model(ids[:, :19], kv_cache=cache)]
        parts += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(19, 30)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)
    # the recurrence runs along the sequence: a sample's logits do not depend on the other samples of the batch,
    # and a position's logits not on later tokens
    changed = ids.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 64
    with torch.no_grad():
        alone = model(ids[1:])
        later = model(changed)
    assert torch.allclose(alone, full[1:], atol=1e-5)
    assert torch.allclose(later[:, :20], full[:, :20], atol=1e-6) and not torch.allclose(later[:, 20:], full[:, 20:])


def test_hugging_face_export_refuses_rwkv_layers() -> None:
    from megatron.model.hf_mapping import neox_to_hf_config

    with pytest.raises(ValueError, match="attention_config 'rwkv' layers"):
        neox_to_hf_config(_cfg(pos_emb="rotary"))


def test_tensor_names_are_gpt_neox_s() -> None:
    model = build_sequential_model(_cfg())
    names = {n.removeprefix("sequential.2.") for n in model.state_dict() if n.startswith("sequential.2.")}
    assert names == set(FIXTURE["blocks"][0]["init_sha256"])


def _args(**over) -> NeoXArgs:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32)
    base.update(attention_config=[[["rwkv"], 2]], train_micro_batch_size_per_gpu=1)
    return NeoXArgs({**base, **over}, env=LaunchEnv(world_size=None, on_cpu=True))


def test_sizes_follow_gpt_neox_s_rules() -> None:
    from megatron.neox_arguments.rwkv_checks import rwkv_sizes

    sizes = rwkv_sizes(_args())
    assert (sizes.dim_att, sizes.head_size, sizes.ffn_dim) == (64, 16, 224)  # int(3.5·64) // 32 · 32
    assert rwkv_sizes(_args(hidden_size=96, num_attention_heads=2)).ffn_dim == 320  # 336 floored to 32s
    assert rwkv_sizes(_args(intermediate_size=100)).ffn_dim == 96
    assert rwkv_sizes(_args(ffn_dim=100, dim_att=32)).ffn_dim == 100  # a given ffn_dim is used as documented
    assert rwkv_sizes(_args(dim_att=32)).head_size == 8
    narrow = rwkv_sizes(_args(hidden_size=48, num_attention_heads=4))  # no multiple of 32 needed (no CUDA kernel)
    assert (narrow.dim_att, narrow.head_size, narrow.ffn_dim) == (48, 12, 160)


def test_weight_decay_skips_every_norm_including_the_group_norm() -> None:
    """``ln1``/``ln2``/``ln_x`` and the final norm get no weight decay; the ``time_*`` parameters and the linear
    weights do (GPT-NeoX's list of no-decay norms omits ``GroupNorm``, so there ``ln_x.weight`` is decayed)."""
    from megatron.model.weight_decay import model_no_weight_decay_names

    names = {n.removeprefix("sequential.2.") for n in model_no_weight_decay_names(_cfg()) if "sequential.2." in n}
    assert names == {f"{m}.{p}" for m in ("ln1", "ln2", "att.ln_x") for p in ("weight", "bias")}


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"model_parallel_size": 2}, "RWKV layers do not support tensor parallelism"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage=3 is not supported with RWKV"),
        ({"num_layers": 1, "attention_config": [[["rwkv"], 1]]}, "num_layers >= 2"),
        ({"head_size": 32}, "head_size=32 disagrees with dim_att // num_attention_heads = 16"),
        ({"dim_att": 66}, "dim_att=66 (RWKV) must be >= 2 and divisible by num_attention_heads=4"),
    ],
)
def test_what_rwkv_refuses(over: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _args(**over)


def test_the_shipped_config_loads_with_its_bf16_loss_scaling_keys_warned_about(caplog) -> None:
    """GPT-NeoX's rwkv/170M.yml writes fp16's loss-scaling keys into its bf16 block: DeepSpeed gets the block
    without them (its bf16 config refuses them) and the user a warning naming them."""
    from tests.unit.test_neox_args_configs import _kwargs

    repo = Path(__file__).resolve().parents[2]
    with caplog.at_level("WARNING"):
        args = NeoXArgs(**_kwargs([str(repo / "configs" / "rwkv" / "170M.yml"), str(repo / "configs/local_setup.yml")]))
    assert args.attention_config == ["rwkv"] * 12 and args.precision == "bfloat16"
    assert args.deepspeed_config["bf16"] == {"enabled": True}
    assert "bf16.loss_scale, bf16.initial_scale_power, bf16.loss_scale_window" in caplog.text
    assert "ignored: bf16 training uses no loss scaling (set in " in caplog.text


def test_the_planner_plans_rwkv(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron.planner.cli import plan_main

    repo = Path(__file__).resolve().parents[2]
    cfg = [str(repo / "configs" / "rwkv" / "170M.yml"), str(repo / "configs" / "local_setup.yml")]
    assert plan_main(["--gpus", "8", "--vocab-size", "50000", "train.py", *cfg]) == 0
    assert "GPT-NeoX's RWKV formula" in capsys.readouterr().out


def test_rwkv_keys_without_rwkv_layers_are_warned_about(caplog) -> None:
    with caplog.at_level("WARNING"):
        _args(attention_config=None, ffn_dim=128, head_size=16)
    assert "ffn_dim=128 is ignored: it sizes RWKV layers and attention_config has none" in caplog.text
    assert "head_size=16 is ignored" in caplog.text and "dim_att" not in caplog.text


def test_parameter_sharing_is_refused_with_rwkv_layers() -> None:
    with pytest.raises(ValueError, match="not supported yet: num_unique_layers=1 with rwkv layers"):
        build_sequential_model(_cfg(num_unique_layers=1))
