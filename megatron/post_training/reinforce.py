"""REINFORCE (``train_impl: reinforce``): GPT-NeoX's loss and KL estimators, and the objective on online rollouts.

With ``d = log p(token) - log p_ref(token)`` per trained token, ``kl_impl`` is ``abs`` (``|d|``), ``mse``
(``d²/2``), ``kl`` (``d``) or ``full`` (``KL(p ‖ p_ref)`` over the whole vocabulary). The loss of a micro-batch is
GPT-NeoX's: ``mean_b( Σ_t mask·(-log p · A + β·kl) / Σ_{b,t} mask )`` with the advantage ``A`` of each row
(its reward minus the baseline), the KL term only when ``kl_div_beta > 0`` (then a frozen copy of the loaded weights
is the reference). Metrics: ``logp``, ``reward`` / ``reward_std`` (the server's rewards), ``ref_logp`` and ``kl``
(with a reference). All equal GPT-NeoX's ``forward_step`` on the same tensors (``tests/fixtures/gpt-neox/``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.engine_protocol import Engine
from megatron.post_training.config import PostTrainingConfig
from megatron.post_training.losses import token_logprobs
from megatron.post_training.objectives import Metrics, SequenceBatch, _broadcast, sequence_batch


def reinforce_logprobs(logits: torch.Tensor, targets: torch.Tensor, fp32: bool) -> torch.Tensor:
    """``log p(target)`` ``[b, s]``: GPT-NeoX's ``get_logp`` (log-softmax, gather) on one TP rank, the vocab-parallel
    cross entropy under tensor parallelism (GPT-NeoX gathers there from the local vocabulary shard)."""
    if mpu.get_model_parallel_world_size() > 1:
        return token_logprobs(logits, targets, fp32)
    logits = logits.float() if fp32 else logits
    return torch.gather(logits.log_softmax(dim=-1), dim=2, index=targets.unsqueeze(2)).squeeze(2)


def full_logprobs(logits: torch.Tensor, fp32: bool) -> torch.Tensor:
    """Log-softmax over the whole vocabulary ``[b, s, V]`` (gathered from the TP ranks)."""
    if mpu.get_model_parallel_world_size() > 1:
        logits = mpu.gather_from_model_parallel_region(logits)
    return (logits.float() if fp32 else logits).log_softmax(dim=-1)


def kl_estimate(
    kl_impl: str, logp: torch.Tensor, ref_logp: torch.Tensor, full: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Per-token KL estimate ``[b, s]``; ``full`` = (policy, reference) log-softmax for ``kl_impl: full``."""
    if kl_impl == "full":
        assert full is not None
        policy, reference = full
        return F.kl_div(reference, policy, log_target=True, reduction="none").sum(-1)
    d = logp - ref_logp
    if kl_impl == "abs":
        return d.abs()
    if kl_impl == "mse":
        return 0.5 * d.square()
    if kl_impl == "kl":
        return d
    raise ValueError(f"kl_impl {kl_impl!r} is not one of abs, mse, kl, full")


def reinforce_loss(
    logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None, beta: float
) -> torch.Tensor:
    """GPT-NeoX's loss: per-token ``-logp·A (+ β·kl)``, masked, each row's sum over the batch's mask sum, mean over
    rows. ``advantages`` is ``[b, 1]``."""
    loss = -logp * advantages if kl is None else (-logp * advantages) + beta * kl
    return ((loss * mask).sum(-1) / mask.sum()).mean()


class ReinforceObjective:
    """Micro-batches of online rollouts (``text``, ``label``, ``reward``, ``raw_reward``) and the REINFORCE loss."""

    def __init__(self, cfg: PostTrainingConfig, eod: int, reference: torch.nn.Module | None) -> None:
        self.cfg, self.eod, self.reference = cfg, eod, reference

    def batch(self, data: dict[str, torch.Tensor] | None) -> SequenceBatch:
        """Tokens, targets and mask of the completions; ``reward`` holds ``[b, 1]`` (advantage, raw reward)."""
        d = _broadcast(data, ["text", "label"], torch.int64)
        r = _broadcast(data, ["reward", "raw_reward"], torch.float32)
        b = sequence_batch(d["text"], d["label"], self.eod, self.cfg.eod_mask_loss)
        b.reward = torch.cat([r["reward"], r["raw_reward"]], dim=1)
        return b

    def _outputs(self, model: Any, b: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = model(b.inputs)
        fp32 = self.cfg.fp32_reinforce
        if self.cfg.kl_impl == "full":
            full = full_logprobs(logits, fp32)
            return torch.gather(full, dim=2, index=b.targets.unsqueeze(2)).squeeze(2), full
        return reinforce_logprobs(logits, b.targets, fp32), None

    def loss(self, engine: Engine, b: SequenceBatch) -> tuple[torch.Tensor, Metrics]:
        """The loss and GPT-NeoX's metrics of one micro-batch."""
        assert b.reward is not None
        advantages, raw = b.reward[:, :1], b.reward[:, 1:]
        metrics: Metrics = {}
        ref_lp = ref_full = None
        if self.reference is not None:
            with torch.no_grad():
                ref_lp, ref_full = self._outputs(self.reference, b)
            metrics["ref_logp"] = ref_lp.detach().mean()
        logp, full = self._outputs(engine, b)
        metrics.update(logp=logp.detach().mean(), reward=raw.detach().mean(), reward_std=raw.detach().std())
        kl = None
        if ref_lp is not None:
            kl = kl_estimate(self.cfg.kl_impl, logp, ref_lp, (full, ref_full) if full is not None else None)  # type: ignore[arg-type]
            metrics["kl"] = kl.detach().mean()
        return reinforce_loss(logp, advantages, b.mask, kl, self.cfg.kl_div_beta), metrics
