"""The fused, chunked output-projection + LM loss equals the logits + ``cross_entropy`` path (loss and gradients),
and the training step uses it only where it applies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.model import GPTModelConfig, build_sequential_model, cross_entropy, get_ltor_masks_and_position_ids
from megatron.model.fused_loss import fused_lm_cross_entropy
from megatron.training.step import uses_fused_loss

V = 96


def tiny(**kw) -> GPTModelConfig:
    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=V, max_position_embeddings=64,
        pos_emb="rotary", rotary_pct=0.25, gpt_j_residual=True, init_method_std=0.2,
    )  # fmt: skip
    base.update(kw)
    return GPTModelConfig(**base)


def batch(b: int = 3, s: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, V, (b, s + 1), generator=g)
    tokens, labels = text[:, :-1], text[:, 1:]
    mask, loss_mask, pos = get_ltor_masks_and_position_ids(tokens, 0, eod_mask_loss=True)
    loss_mask[0, :5] = 0.0  # some masked tokens
    return (tokens, pos, mask), (labels, loss_mask)


@pytest.mark.parametrize("untied", [True, False])
def test_fused_model_loss_and_grads_equal_unfused(untied):
    torch.manual_seed(0)
    model = build_sequential_model(tiny(no_weight_tying=untied))
    inputs, targets = batch()
    assert model.fused_loss_weight() is not None
    ref = cross_entropy(model(inputs), targets)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fused = model(inputs, loss_targets=targets)
    fused.backward()
    torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation: no gradient work, same loss
        torch.testing.assert_close(model(inputs, loss_targets=targets), ref.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 7, 48, 1000])
def test_chunking_does_not_change_the_result(chunk_rows):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 24, 16, generator=g, requires_grad=True)
    weight = torch.randn(V, 16, generator=g, requires_grad=True)
    target = torch.randint(0, V, (2, 24), generator=g)
    mask = (torch.rand(2, 24, generator=g) > 0.3).float()
    logits = hidden @ weight.t()
    ref = cross_entropy(logits, (target, mask))
    gh, gw = torch.autograd.grad(ref * 2.5, (hidden, weight))
    out = fused_lm_cross_entropy(hidden, weight, target, mask, chunk_rows=chunk_rows)
    fh, fw = torch.autograd.grad(out * 2.5, (hidden, weight))  # the incoming gradient scales both
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fh, gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fw, gw, rtol=1e-5, atol=1e-6)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="must agree"):
        fused_lm_cross_entropy(torch.zeros(2, 4, 8), torch.zeros(V, 8), torch.zeros(2, 5, dtype=torch.long),
                               torch.ones(2, 5))  # fmt: skip


def test_step_uses_fused_loss_only_for_the_lm_loss_of_a_capable_model():
    model = build_sequential_model(tiny(no_weight_tying=True))
    engine = SimpleNamespace(module=model)
    assert uses_fused_loss(engine, cross_entropy)
    assert not uses_fused_loss(engine, lambda logits, targets: cross_entropy(logits, targets))  # custom objective
    assert not uses_fused_loss(SimpleNamespace(module=torch.nn.Linear(2, 2)), cross_entropy)
    fp16_ce = build_sequential_model(tiny(fp16_lm_cross_entropy=True))
    assert fp16_ce.fused_loss_weight() is None
    with pytest.raises(ValueError, match="cannot fuse"):
        fp16_ce(batch()[0], loss_targets=batch()[1])


def test_single_rank_allreduce_is_skipped_only_where_it_can_only_copy():
    from megatron.training.deepspeed_adapter import skip_single_rank_allreduce

    def engine(stage: int = 0, optimizer: object = None, **kw: object) -> SimpleNamespace:
        opt = optimizer if optimizer is not None else torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
        return SimpleNamespace(optimizer=opt, zero_optimization_stage=lambda: stage, enable_backward_allreduce=True,
                               **kw)  # fmt: skip

    e = engine()
    assert skip_single_rank_allreduce(e, 1) and e.enable_backward_allreduce is False
    for e, dp in ((engine(), 2), (engine(stage=1), 1), (engine(pipeline_parallelism=True), 1),
                  (engine(has_moe_layers=True), 1), (engine(optimizer=object()), 1)):  # fmt: skip
        assert not skip_single_rank_allreduce(e, dp) and e.enable_backward_allreduce is True


def test_nonfinite_guard_check_finds_nan_and_inf_in_any_gradient():
    from megatron.training.nonfinite import _all_finite

    ok = [torch.ones(3), torch.full((2, 2), 3e38), torch.zeros(0)]
    assert _all_finite(ok) and _all_finite([])
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.ones(5)
        t[3] = bad
        assert not _all_finite([*ok, t]) and not _all_finite([t.bfloat16()])
