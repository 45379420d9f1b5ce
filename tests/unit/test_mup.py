"""muP (``megatron/model/mup.py``, ``megatron/training/mup_setup.py``) against Microsoft's ``mup`` 1.0.0, the package
GPT-NeoX uses: base shapes files byte for byte, MuAdam's/MuSGD's per-parameter learning rates and weight decays, and
``mup.init.normal_``'s scaling, all computed by mup on this project's own model (``tests/fixtures/mup/``, made by
``make_fixtures.py`` there); and the forward multipliers and config errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.model import GPTModelConfig, build_sequential_model, get_ltor_masks_and_position_ids
from megatron.model.mup import (
    MupConfig,
    apply_mup,
    base_shapes_text,
    make_base_shapes,
    read_base_shapes,
    shapes_of,
)
from megatron.neox_arguments import neox_namespace
from megatron.neox_arguments.errors import ConfigError
from megatron.training.learning_rates import AnnealingLR, LRScheduleConfig
from megatron.training.mup_setup import prepare_mup, save_base_shapes
from megatron.training.optimizer_config import OptimizerConfig
from megatron.training.optimizers import build_optimizer, weight_decay_param_groups

FIXTURES = Path(__file__).parents[1] / "fixtures" / "mup"
MUP = json.loads((FIXTURES / "mup_1.0.0.json").read_text(encoding="utf-8"))
V = 64


def cfg(hidden: int, untied: bool = False, **kw: Any) -> GPTModelConfig:
    """The fixtures' model (make_fixtures.py)."""
    base: dict[str, Any] = dict(
        num_layers=2, hidden_size=hidden, num_attention_heads=4, padded_vocab_size=V, max_position_embeddings=32,
        pos_emb="learned", no_weight_tying=untied,
    )  # fmt: skip
    base.update(kw)
    return GPTModelConfig(**base)


def tag(untied: bool) -> str:
    return "untied" if untied else "tied"


@pytest.mark.parametrize("untied", [False, True])
def test_base_shapes_file_is_mups_and_reads_back(tmp_path: Path, untied: bool) -> None:
    """save_base_shapes writes ``{base_shapes_file}.{rank}`` with exactly mup's text for the base (hidden 32) and
    delta (32 · mup_width_scale 2) models; base_shapes_file reads it back."""
    mup_cfg = MupConfig(use_mup=True, save_base_shapes=True, base_shapes_file=str(tmp_path / "shapes" / "run.bsh"))
    path = save_base_shapes(mup_cfg, cfg(32, untied), build_sequential_model, rank=3)
    assert path == tmp_path / "shapes" / "run.bsh.3"
    expected = (FIXTURES / f"base_shapes_{tag(untied)}.bsh").read_text(encoding="utf-8")
    assert path.read_text(encoding="utf-8") == expected
    shapes = read_base_shapes(path)
    base = shapes_of(build_sequential_model(cfg(32, untied)))
    delta = shapes_of(build_sequential_model(cfg(64, untied)))
    assert shapes == make_base_shapes(base, delta)
    assert base_shapes_text(shapes) == expected
    assert shapes["sequential.2.attention.query_key_value.weight"] == [96, 32]  # both dims are widths
    assert shapes["sequential.0.word_embeddings.weight"] == [None, 32]  # the vocabulary is finite


def _model_with_mup(untied: bool, **mup_kw: Any) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = build_sequential_model(cfg(128, untied))  # 4x the base width
    bsh = FIXTURES / f"base_shapes_{tag(untied)}.bsh"
    mup_cfg = MupConfig(use_mup=True, base_shapes_file=str(bsh), **mup_kw)
    return model, apply_mup(model, mup_cfg, model.cfg, read_base_shapes(bsh), str(bsh))


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("untied", [False, True])
def test_param_group_lr_and_weight_decay_equal_mups(optimizer: str, untied: bool) -> None:
    """Each parameter's lr and weight decay equal MuAdam's / MuSGD's (lr/4 and wd·4 for Adam's hidden matrices at 4x
    width; lr·4 for SGD's vector-like ones), from the same weight-decay groups."""
    model, shapes = _model_with_mup(untied)
    groups = shapes.param_groups(weight_decay_param_groups(model, MUP["weight_decay"]), optimizer, MUP["lr"])
    names = {id(p): n for n, p in model.named_parameters()}
    ours = {names[id(p)]: {"lr": g["lr"], "weight_decay": g["weight_decay"]} for g in groups for p in g["params"]}
    expected = MUP["models"][tag(untied)][optimizer]
    assert ours.keys() == expected.keys()
    for name, want in expected.items():
        assert ours[name] == pytest.approx(want), name
    qkv = "sequential.2.attention.query_key_value.weight"
    assert ours[qkv]["lr"] == pytest.approx(MUP["lr"] / 4 if optimizer == "adam" else MUP["lr"])


def test_the_lr_schedule_keeps_each_groups_ratio() -> None:
    """Through build_optimizer and AnnealingLR (the training path): at every step a hidden matrix's lr is the
    schedule's lr · base_width/width = lr/4, a vector-like parameter's the schedule's lr."""
    model, shapes = _model_with_mup(untied=False)
    opt_cfg = OptimizerConfig(optimizer={"type": "Adam", "params": {"lr": 0.01}}, lr=0.01, weight_decay=0.1)
    optimizer, _ = build_optimizer(model, opt_cfg, shapes)
    assert optimizer is not None
    sched = AnnealingLR(optimizer, LRScheduleConfig(lr=0.01, min_lr=0.001, train_iters=10, warmup=0.2, use_mup=True))
    qkv = dict(model.named_parameters())["sequential.2.attention.query_key_value.weight"]
    norm = dict(model.named_parameters())["sequential.2.input_layernorm.weight"]

    def lr_of(p: torch.nn.Parameter) -> float:
        return next(g["lr"] for g in optimizer.param_groups if any(q is p for q in g["params"]))

    for step in (1, 2, 5, 9):
        sched.step(step)
        assert lr_of(norm) == pytest.approx(sched.get_lr())
        assert lr_of(qkv) == pytest.approx(sched.get_lr() / 4)


@pytest.mark.parametrize("untied", [False, True])
def test_init_scaling_equals_mups_normal_init(untied: bool) -> None:
    """The parallel layers' weights become mup.init.normal_'s draw (hidden matrices std · width_mult^-1/2), times
    mup_init_scale; other parameters (norms, learned positions: not re-initialised by GPT-NeoX) are untouched."""
    torch.manual_seed(0)
    before = {n: p.detach().clone() for n, p in build_sequential_model(cfg(128, untied)).named_parameters()}
    model, _ = _model_with_mup(untied, mup_init_scale=0.5)
    expected = MUP["models"][tag(untied)]["init_normal_ratio"]
    parallel = {
        f"{n}.weight"
        for n, m in model.named_modules()
        if isinstance(m, (mpu.ColumnParallelLinear, mpu.RowParallelLinear, mpu.VocabParallelEmbedding))
    }
    for name, p in model.named_parameters():
        ratio = p.detach() / before[name]
        if name in parallel:
            assert torch.allclose(ratio, torch.full_like(ratio, 0.5 * expected[name])), name
        else:
            assert torch.equal(p.detach(), before[name]), name
    assert expected["sequential.2.mlp.linear1.weight"] == pytest.approx(0.5)  # 4x width: 4^-1/2


def _batch(b: int = 2, s: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (b, s), generator=g)
    mask, _, pos = get_ltor_masks_and_position_ids(tokens, 0)
    return tokens, pos, mask


@pytest.mark.parametrize("untied", [False, True])
def test_readout_multiplier_is_one_over_width_mult_times_temperature(untied: bool) -> None:
    """Logits = W · h / (width_mult · mup_output_temp) (mup's MuReadout), h the final norm's output."""
    model, _ = _model_with_mup(untied, mup_output_temp=2.0)
    seen: list[torch.Tensor] = []
    model.sequential[-2].register_forward_hook(lambda _m, _i, out: seen.append(out))
    logits = model(*_batch())
    weight = model.sequential[-1].final_linear.weight if untied else model.sequential[0].word_embeddings.weight
    assert torch.allclose(logits, F.linear(seen[0] / (4 * 2.0), weight), atol=1e-6)


def test_attention_scale_is_one_over_d_times_temperature() -> None:
    """With use_mup the softmax input is q·k/(d · mup_attn_temp): at temperature 1/sqrt(d) the logits equal standard
    parametrisation's (same weights), at temperature 1 they do not."""
    torch.manual_seed(0)
    sp = build_sequential_model(cfg(64, hidden_dropout=0.0, attention_dropout=0.0))
    head_dim = 64 // 4
    batch = _batch()
    for explicit in (False, True):  # SDPA, and the explicit path (apply_query_key_layer_scaling)
        kw = dict(hidden_dropout=0.0, attention_dropout=0.0, apply_query_key_layer_scaling=explicit)
        ref = build_sequential_model(cfg(64, **kw))
        ref.load_state_dict(sp.state_dict())
        equal = build_sequential_model(cfg(64, use_mup=True, mup_attn_temp=head_dim**-0.5, **kw))
        equal.load_state_dict(sp.state_dict())
        other = build_sequential_model(cfg(64, use_mup=True, mup_attn_temp=1.0, **kw))
        other.load_state_dict(sp.state_dict())
        assert torch.allclose(equal(*batch), ref(*batch), atol=1e-5)
        assert not torch.allclose(other(*batch), ref(*batch), atol=1e-3)


def test_embedding_multipliers() -> None:
    """use_mup: the embedding output times mup_embedding_mult; learned positions times mup_rp_embedding_mult (as
    GPT-NeoX, with or without use_mup)."""
    torch.manual_seed(0)
    plain = build_sequential_model(cfg(64)).sequential[0]
    tokens, pos, mask = _batch()
    words = plain.word_embeddings(tokens)
    positions = plain.position_embeddings(pos, words.dtype)
    plain((tokens, pos, mask))[0].sum().backward()
    grad_plain = plain.word_embeddings.weight.grad
    assert grad_plain is not None
    words, positions = words.detach(), positions.detach()
    for use_mup, mult, rp in ((True, 3.0, 1.0), (True, 1.0, 0.5), (False, 3.0, 0.5)):
        emb = build_sequential_model(cfg(64, use_mup=use_mup, mup_embedding_mult=mult, mup_rp_embedding_mult=rp))
        emb = emb.sequential[0]
        emb.load_state_dict(plain.state_dict())
        want = (words + rp * positions) * (mult if use_mup else 1.0)
        out = emb((tokens, pos, mask))[0]
        assert torch.allclose(out, want, atol=1e-6)
        out.sum().backward()  # the multiplier is differentiated through (GPT-NeoX's in-place no_grad one is not)
        grad = emb.word_embeddings.weight.grad
        assert grad is not None and torch.allclose(grad, grad_plain * (mult if use_mup else 1.0))


def test_user_errors_name_the_key_and_file(tmp_path: Path) -> None:
    args = neox_namespace(use_mup=True)
    with pytest.raises(ConfigError, match="base_shapes_file"):
        MupConfig.from_neox_args(args)
    model = build_sequential_model(cfg(64))
    mup_cfg = MupConfig(use_mup=True, base_shapes_file=str(tmp_path / "x.bsh"))
    with pytest.raises(ConfigError, match=r"x\.bsh\.0 does not exist.*save_base_shapes"):
        prepare_mup(model, mup_cfg, model.cfg, 0)
    save_base_shapes(mup_cfg, cfg(64, untied=True), build_sequential_model, 0)  # another architecture's file
    with pytest.raises(ConfigError, match=r"x\.bsh\.0 does not describe this model"):
        prepare_mup(model, mup_cfg, model.cfg, 0)
    (tmp_path / "x.bsh.0").write_text("a: [1, x]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="is not a base shapes file"):
        prepare_mup(model, mup_cfg, model.cfg, 0)
    save_base_shapes(mup_cfg, cfg(64), build_sequential_model, 0)
    shapes = prepare_mup(model, mup_cfg, model.cfg, 0)
    assert shapes is not None
    with pytest.raises(ConfigError, match="use_mup: the optimizer must be one of adam, sgd"):
        shapes.param_groups(weight_decay_param_groups(model, 0.0), "lion", 1e-3)
    xavier = build_sequential_model(cfg(64, init_method="xavier_normal"))
    with pytest.raises(ConfigError, match="init_method: xavier_normal is not supported yet"):
        prepare_mup(xavier, mup_cfg, xavier.cfg, 0)
    assert prepare_mup(model, MupConfig(), model.cfg, 0) is None  # without use_mup nothing happens
