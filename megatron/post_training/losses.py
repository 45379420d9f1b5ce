"""The post-training losses as pure functions of per-sequence scores (formulas from GPT-NeoX's ``post-training``).

Sequence log-probabilities are masked sums of per-token log-probs; with tensor parallelism the logits are
vocab-parallel and the per-token log-prob is minus the vocab-parallel cross entropy, so every TP rank gets the
same value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron import mpu


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """``log p(target)`` per token, ``[b, s]``, from vocab-parallel logits ``[b, s, V/tp]``."""
    logits = logits.float() if fp32 else logits
    return -mpu.vocab_parallel_cross_entropy(logits.contiguous(), targets)


def sequence_logprobs(token_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked sum over the sequence: ``[b, s] -> [b]`` (positions with mask 0 contribute nothing)."""
    return (token_lp * mask.to(token_lp.dtype)).sum(dim=-1)


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-mean log σ(β[(S⁺-S⁻)-(R⁺-R⁻)])``; reference log-probs ``None`` = reference-free (R = 0).

    Returns the loss and the detached metrics ``chosen_pos``/``chosen_neg`` (S⁺/S⁻), ``ref_pos``/``ref_neg`` (R⁺/R⁻,
    with a reference), ``chosen_rewards``, ``rejected_rewards``, ``reward_acc``, ``margins`` (rewards are ``β (S - R)``,
    GPT-NeoX's names and definitions).
    """
    ref_c = torch.zeros_like(chosen) if ref_chosen is None else ref_chosen.to(chosen.dtype)
    ref_r = torch.zeros_like(rejected) if ref_rejected is None else ref_rejected.to(rejected.dtype)
    logits = (chosen - rejected) - (ref_c - ref_r)
    loss = -F.logsigmoid(beta * logits).mean()
    chosen_rewards = beta * (chosen - ref_c).detach()
    rejected_rewards = beta * (rejected - ref_r).detach()
    metrics = {
        "chosen_pos": chosen.detach().mean(),
        "chosen_neg": rejected.detach().mean(),
        "chosen_rewards": chosen_rewards.mean(),
        "rejected_rewards": rejected_rewards.mean(),
        "reward_acc": (chosen_rewards > rejected_rewards).float().mean(),
        "margins": (chosen_rewards - rejected_rewards).mean(),
    }
    if ref_chosen is not None and ref_rejected is not None:
        metrics.update(ref_pos=ref_c.detach().mean(), ref_neg=ref_r.detach().mean())
    return loss, metrics


def kto_kl(policy_kl: torch.Tensor, ref_kl: torch.Tensor) -> torch.Tensor:
    """The KL estimate ``mean(π_KL - ref_KL)``, clamped at 0 and detached (GPT-NeoX's ``KL``)."""
    return (policy_kl - ref_kl).mean().clamp(min=0).detach()


def kto_loss(
    policy: torch.Tensor,
    ref: torch.Tensor,
    kl: torch.Tensor,
    desirable: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO: ``w_d (1 - σ(β(r - KL)))`` for desirable and ``w_u (1 - σ(β(KL - r)))`` for undesirable examples,
    averaged over the batch, with ``r = log π - log π_ref`` per sequence and ``kl`` from :func:`kto_kl`.

    ``desirable`` is a bool tensor ``[b]`` (reward > 0).
    """
    logratio = policy - ref
    want = desirable.bool()
    per_example = torch.where(
        want,
        desirable_weight * (1 - torch.sigmoid(beta * (logratio - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratio))),
    )
    rewards = beta * logratio.detach()
    zero = rewards.new_zeros(())
    metrics = {
        "chosen_rewards": rewards[want].mean() if want.any() else zero,
        "rejected_rewards": rewards[~want].mean() if (~want).any() else zero,
        "kl": kl.detach(),
    }
    return per_example.mean(), metrics


def rm_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, z_loss: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model loss ``-mean log σ(r⁺-r⁻) + z_loss · mean(r⁺² + r⁻²)`` on scalar rewards ``[b]``."""
    chosen, rejected = chosen.float(), rejected.float()
    loss = -F.logsigmoid(chosen - rejected).mean()
    if z_loss:
        loss = loss + z_loss * (chosen.square() + rejected.square()).mean()
    metrics = {
        "chosen_rewards": chosen.detach().mean(),
        "rejected_rewards": rejected.detach().mean(),
        "reward_acc": (chosen > rejected).float().mean().detach(),
        "margins": (chosen - rejected).detach().mean(),
    }
    return loss, metrics
