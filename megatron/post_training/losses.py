"""The post-training losses as pure functions of log-probs and scores (formulas and metrics as GPT-NeoX computes
them, checked against its outputs in ``tests/fixtures/gpt-neox/``; differences in ``docs/gpt-neox-differences.md``).

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

    Returns the loss and the detached metrics ``chosen_pos``/``chosen_neg`` (S⁺/S⁻) and, with a reference,
    ``ref_pos``/``ref_neg`` (R⁺/R⁻), ``chosen_rewards``, ``rejected_rewards``, ``reward_acc``, ``margins`` (rewards are
    ``β (S - R)``). Names, definitions and the reference-free set match GPT-NeoX (golden-tested).
    """
    ref_c = torch.zeros_like(chosen) if ref_chosen is None else ref_chosen.to(chosen.dtype)
    ref_r = torch.zeros_like(rejected) if ref_rejected is None else ref_rejected.to(rejected.dtype)
    logits = (chosen - rejected) - (ref_c - ref_r)
    loss = -F.logsigmoid(beta * logits).mean()
    metrics = {"chosen_pos": chosen.detach().mean(), "chosen_neg": rejected.detach().mean()}
    if ref_chosen is not None and ref_rejected is not None:
        chosen_rewards = beta * (chosen - ref_c).detach()
        rejected_rewards = beta * (rejected - ref_r).detach()
        metrics.update(
            ref_pos=ref_c.detach().mean(),
            ref_neg=ref_r.detach().mean(),
            chosen_rewards=chosen_rewards.mean(),
            rejected_rewards=rejected_rewards.mean(),
            reward_acc=(chosen_rewards > rejected_rewards).float().mean(),
            margins=(chosen_rewards - rejected_rewards).mean(),
        )
    return loss, metrics


# |reward| below this counts as no reward (weight 0), as in GPT-NeoX
KTO_REWARD_EPS = 1e-3


def kto_kl(policy: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """KL reference point of a group of sequences: each sequence's ``S - R`` clamped at 0, then averaged; detached.

    (Clamping per sequence before averaging is GPT-NeoX's order: log-ratios ``[2, -3]`` give 1.0, not 0.)
    """
    return (policy - ref).clamp(min=0).mean().detach()


def kto_loss(
    policy: torch.Tensor,
    ref: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO as GPT-NeoX computes it, on per-token tensors ``[n, s]``: masked log-probs ``policy``/``ref`` (0 where
    ``mask`` is 0) and the reward row of each sequence (its document's reward on the document's positions, 0 on
    padding).

    The micro-batch is split in two halves (``torch.chunk``: the first gets the extra row of an odd batch); for a
    row ``i`` of half ``h`` with log-ratio ``r_i = Σ(policy - ref)``, mean reward ``ρ_i`` (over all ``s`` positions,
    so document length matters) and the other half's :func:`kto_kl` ``KL``::

        loss = Σ_h 0.5 · mean_h(w) · mean_{i∈h}(1 - σ(β ρ_i (r_i - KL)))

    where ``w`` is ``desirable_weight`` for a row whose rewards sum above 1e-3, ``undesirable_weight`` below
    -1e-3, and 0 otherwise (a zero reward trains nothing). With equal halves this is GPT-NeoX's formula exactly; an
    odd batch of 3 also matches (GPT-NeoX broadcasts the lone row), larger odd batches fail there.
    """
    rewards = rewards.to(policy.dtype)
    total = rewards.sum(-1)
    weight = (total > KTO_REWARD_EPS).to(policy.dtype) * desirable_weight
    weight = weight + (total < -KTO_REWARD_EPS).to(policy.dtype) * undesirable_weight
    logratio = (policy - ref).sum(-1)
    halves = list(zip(logratio.chunk(2), rewards.mean(-1).chunk(2), weight.chunk(2)))
    kls = [kto_kl(p.sum(-1), r.sum(-1)) for p, r in zip(policy.chunk(2), ref.chunk(2))]
    loss = policy.new_zeros(())
    for h, (ratio, rho, w) in enumerate(halves):
        other_kl = kls[1 - h] if len(kls) == 2 else kls[0]
        loss = loss + 0.5 * w.mean() * (1 - torch.sigmoid(beta * rho * (ratio - other_kl))).mean()
    return loss, kto_metrics(policy, ref, rewards, mask, beta)


def kto_metrics(
    policy: torch.Tensor, ref: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, beta: float
) -> dict[str, torch.Tensor]:
    """GPT-NeoX's KTO metrics (same names and definitions): mean sequence log-probs (all, desirable and undesirable
    tokens), the per-token ``kl``, ``reward_acc`` and the summed ``policy_rewards``."""
    policy, ref = policy.detach(), ref.detach()
    pos = (rewards > KTO_REWARD_EPS).to(policy.dtype)
    neg = (rewards < -KTO_REWARD_EPS).to(policy.dtype)
    policy_rewards = beta * rewards * (policy - ref)
    return {
        "ref_logp": ref.sum(-1).mean(),
        "policy_logp": policy.sum(-1).mean(),
        "pos_ref_logp": (ref * pos).sum(-1).mean(),
        "neg_ref_logp": (ref * neg).sum(-1).mean(),
        "pos_policy_logp": (policy * pos).sum(-1).mean(),
        "neg_policy_logp": (policy * neg).sum(-1).mean(),
        "kl": (policy - ref).sum() / mask.sum().clamp(min=1),
        "reward_acc": (policy_rewards.sum(-1) > 0).float().mean(),
        "policy_rewards": policy_rewards.sum(),
    }


def rm_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, z_loss: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model loss ``-mean log σ(r⁺-r⁻) + z_loss · mean(r⁺² + r⁻²)`` on scalar rewards ``[b]``; metrics under
    GPT-NeoX's names ``pos_values``, ``neg_values``, ``margin``, ``accuracy``."""
    chosen, rejected = chosen.float(), rejected.float()
    loss = -F.logsigmoid(chosen - rejected).mean()
    if z_loss:
        loss = loss + z_loss * (chosen.square() + rejected.square()).mean()
    metrics = {
        "pos_values": chosen.detach().mean(),
        "neg_values": rejected.detach().mean(),
        "margin": (chosen - rejected).detach().mean(),
        "accuracy": (chosen > rejected).float().mean().detach(),
    }
    return loss, metrics
