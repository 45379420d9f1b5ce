"""Post-training losses against values computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.post_training.losses import dpo_loss, kto_kl, kto_loss, rm_loss, sequence_logprobs, token_logprobs


def _log1pexp(x: float) -> float:  # -log σ(-x)
    return math.log(1.0 + math.exp(x))


def test_sequence_logprobs_sum_only_masked_positions() -> None:
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    assert sequence_logprobs(lp, mask).tolist() == [-4.0, -4.0]


def test_token_logprobs_are_log_softmax_at_the_target() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(2.0), math.log(2.0)]]])
    lp = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert lp.shape == (1, 2)
    assert lp[0, 0].item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert lp[0, 1].item() == pytest.approx(math.log(0.5), abs=1e-6)


def test_dpo_loss_with_reference() -> None:
    c, r = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-2.5, -1.5])
    loss, m = dpo_loss(c, r, rc, rr, beta=0.5)
    # logits = (c - r) - (rc - rr) = [1, -0.5]; loss = mean(log(1 + e^{-β·logit}))
    assert loss.item() == pytest.approx((_log1pexp(-0.5) + _log1pexp(0.25)) / 2, abs=1e-6)
    # chosen rewards β(c - rc) = [0.25, 0]; rejected β(r - rr) = [-0.25, 0.25]
    assert m["chosen_rewards"].item() == pytest.approx(0.125)
    assert m["rejected_rewards"].item() == pytest.approx(0.0)
    assert m["reward_acc"].item() == pytest.approx(0.5)
    assert m["margins"].item() == pytest.approx(0.125)


def test_dpo_loss_reference_free_uses_zero_reference() -> None:
    c, r = torch.tensor([-1.0]), torch.tensor([-3.0])
    loss, m = dpo_loss(c, r, None, None, beta=0.1)
    assert loss.item() == pytest.approx(_log1pexp(-0.2), abs=1e-6)
    assert sorted(m) == ["chosen_neg", "chosen_pos"]  # GPT-NeoX logs no rewards without a reference


def test_dpo_loss_is_log2_when_policy_equals_reference() -> None:
    c, r = torch.tensor([-7.25, -1.5, -3.0]), torch.tensor([-2.0, -9.0, -3.0])
    loss, m = dpo_loss(c, r, c.clone(), r.clone(), beta=0.1)
    assert loss.item() == torch.tensor(math.log(2.0)).item()  # exactly log 2 in fp32
    assert m["margins"].item() == 0.0


def test_dpo_loss_gradient_reaches_policy_only() -> None:
    c = torch.tensor([-1.0], requires_grad=True)
    r = torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(c, r, torch.tensor([-1.0]), torch.tensor([-2.0]), beta=1.0)
    loss.backward()
    # d/dc [-log σ(c - r - 1)] at 0 = -(1 - σ(0)) = -0.5
    assert c.grad.item() == pytest.approx(-0.5) and r.grad.item() == pytest.approx(0.5)


def test_kto_kl_clamps_each_sequence_then_averages_and_is_detached() -> None:
    # log-ratios [1, -1]: per-sequence clamp then mean = 0.5 (mean then clamp would give 0)
    assert kto_kl(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0])).item() == 0.5
    assert kto_kl(torch.tensor([-1.0]), torch.tensor([-2.0])).item() == 1.0
    assert kto_kl(torch.tensor([-3.0]), torch.tensor([-1.0])).item() == 0.0
    assert not kto_kl(torch.tensor([1.0], requires_grad=True), torch.tensor([0.0])).requires_grad


def test_kto_loss_by_hand() -> None:
    """Two rows of length 2; each half's KL is the other row's clamped log-ratio; β scaled by the mean reward of
    the row; weights averaged per half; a zero reward weighs 0."""
    policy = torch.tensor([[-1.0, 0.0], [-2.0, -1.0]])
    ref = torch.tensor([[-1.5, 0.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    rewards = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])  # row means 1.0 and -0.5
    loss, m = kto_loss(policy, ref, rewards, mask, beta=1.0, undesirable_weight=2.0)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # log-ratios [0.5, -1]; KL of row 0's half = max(0, -1) = 0, of row 1's half = 0.5
    want = 0.5 * 1.0 * (1 - sig(1.0 * (0.5 - 0.0))) + 0.5 * 2.0 * (1 - sig(-0.5 * (-1.0 - 0.5)))
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert m["kl"].item() == pytest.approx(-0.5 / 4) and m["reward_acc"].item() == 1.0
    zero, _ = kto_loss(policy, ref, torch.zeros(2, 2), mask, beta=1.0)
    assert zero.item() == 0.0


def test_rm_loss_with_z_loss() -> None:
    loss, m = rm_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), z_loss=0.1)
    expected = (_log1pexp(-1.0) + _log1pexp(1.0)) / 2 + 0.1 * ((4 + 1) + (0 + 1)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["accuracy"].item() == 0.5
    plain, _ = rm_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert plain.item() == pytest.approx((_log1pexp(-1.0) + _log1pexp(1.0)) / 2, abs=1e-6)


def test_reward_is_read_at_the_last_trained_position() -> None:
    from megatron.post_training.objectives import last_trained_position

    mask = torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert last_trained_position(mask).tolist() == [2, 1, 0]


def test_dpo_on_masked_sequences_ignores_masked_tokens() -> None:
    lp_c = torch.tensor([[-1.0, -50.0, -2.0]])
    lp_r = torch.tensor([[-99.0, -3.0, -1.0]])
    mask_c, mask_r = torch.tensor([[1, 0, 1]]), torch.tensor([[0, 1, 1]])
    loss, _ = dpo_loss(sequence_logprobs(lp_c, mask_c), sequence_logprobs(lp_r, mask_r), None, None, beta=1.0)
    # S+ = -3, S- = -4: loss = log(1 + e^{-1})
    assert loss.item() == pytest.approx(_log1pexp(-1.0), abs=1e-6)
