"""The post-training objectives: each turns a loader batch into model inputs and a loss, chosen once at setup.

* :class:`DPOObjective` — pairwise; chosen and rejected sequences go through the model as one ``[2b, s]`` batch;
  reference log-probs from a frozen copy of the loaded weights, from the precomputed ``pos_ref``/``neg_ref``
  streams (``precompute_model_name``), or 0 (``dpo_reference_free``).
* :class:`RewardModelObjective` — pairwise; the model's ``rm_linear`` head scores each sequence at its last trained
  position (the final EOS written by ``--for-rm``).
* :class:`KTOObjective` — single sequences with a reward each, GPT-NeoX's formula (β scaled by the mean reward of
  the row); the KL reference point of each half of the micro-batch is estimated on the other half; reference log-probs from a frozen copy or the precomputed ``ref``
  stream.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.engine_protocol import Engine
from megatron.model import get_ltor_masks_and_position_ids
from megatron.post_training.config import PostTrainingConfig
from megatron.post_training.losses import dpo_loss, kto_loss, rm_loss, sequence_logprobs, token_logprobs

Metrics = dict[str, torch.Tensor]


@dataclass
class SequenceBatch:
    """Model inputs plus the shifted targets and the mask of trained positions (labels >= 0)."""

    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, position_ids, attention_mask
    targets: torch.Tensor  # [n, s]
    mask: torch.Tensor  # [n, s], 1 where trained
    reward: torch.Tensor | None = None  # [n, s] (KTO): the document's reward on its positions, 0 on padding
    reference: torch.Tensor | None = None  # [n, s] precomputed reference log-prob of each target


def _broadcast(data: dict[str, torch.Tensor] | None, keys: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    device = get_accelerator().current_device_name()
    return {k: v.to(device) for k, v in mpu.broadcast_data(keys, data, dtype).items()}


def sequence_batch(text: torch.Tensor, label: torch.Tensor, eod: int, eod_mask_loss: bool = False) -> SequenceBatch:
    """The model reads ``text[:, :-1]`` and is scored on ``label[:, 1:]`` where it is >= 0 and, with
    ``eod_mask_loss``, where the input token is not EOD (GPT-NeoX's batch: golden-tested)."""
    tokens = text[:, :-1].contiguous()
    shifted = label[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, eod, eod_mask_loss)
    mask = (shifted >= 0).float() * loss_mask.float()
    return SequenceBatch((tokens, position_ids, attention_mask), shifted.clamp(min=0), mask)


def kto_reward_rows(reward: torch.Tensor) -> torch.Tensor:
    """The reward rows ``[n, s]`` of KTO samples ``[n, s + 1]``: the last value is dropped, as GPT-NeoX does (the
    reward at input position ``t`` goes with the target ``t+1``)."""
    return reward[:, :-1].contiguous().float()


def precomputed_reference(data: dict[str, torch.Tensor] | None, keys: list[str]) -> torch.Tensor:
    """The precomputed per-token reference log-probs of ``keys`` stacked as rows, aligned with the targets
    (value ``t`` scores token ``t+1``, so the last of the ``seq_length + 1`` values is dropped)."""
    d = _broadcast(data, keys, torch.float32)
    return torch.cat([d[k] for k in keys])[:, :-1].contiguous()


def frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    """The reference model: a copy of the (loaded) weights in eval mode, without gradients."""
    ref = copy.deepcopy(module)
    ref.eval()
    ref.requires_grad_(False)
    return ref


class PairwiseObjective:
    """Chosen/rejected batches: ``pos``/``neg`` token streams and their label streams."""

    keys = ("pos", "neg", "pos_label", "neg_label")

    def __init__(self, cfg: PostTrainingConfig, eod: int) -> None:
        self.cfg, self.eod = cfg, eod

    def batch(self, data: dict[str, torch.Tensor] | None) -> SequenceBatch:
        """Chosen rows first, then rejected rows (and their precomputed reference log-probs, when read)."""
        d = _broadcast(data, list(self.keys), torch.int64)
        b = sequence_batch(
            torch.cat([d["pos"], d["neg"]]), torch.cat([d["pos_label"], d["neg_label"]]), self.eod,
            self.cfg.eod_mask_loss,
        )  # fmt: skip
        if self.cfg.reads_precomputed_reference:
            b.reference = precomputed_reference(data, ["pos_ref", "neg_ref"])
        return b


class DPOObjective(PairwiseObjective):
    """``-mean log σ(β[(S⁺-S⁻)-(R⁺-R⁻)])`` on masked sequence log-prob sums."""

    def __init__(self, cfg: PostTrainingConfig, eod: int, reference: torch.nn.Module | None) -> None:
        super().__init__(cfg, eod)
        self.reference = reference

    def _logprobs(self, model: Any, b: SequenceBatch) -> torch.Tensor:
        return sequence_logprobs(token_logprobs(model(b.inputs), b.targets, self.cfg.dpo_fp32), b.mask)

    def loss(self, engine: Engine, b: SequenceBatch) -> tuple[torch.Tensor, Metrics]:
        """The DPO loss and its reward metrics."""
        chosen, rejected = self._logprobs(engine, b).chunk(2)
        ref_c = ref_r = None
        if b.reference is not None:
            ref_c, ref_r = sequence_logprobs(b.reference, b.mask).chunk(2)
        elif self.reference is not None:
            with torch.no_grad():
                ref_c, ref_r = self._logprobs(self.reference, b).chunk(2)
        return dpo_loss(chosen, rejected, ref_c, ref_r, self.cfg.dpo_beta)


def last_trained_position(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with mask 1 in each row (0 for a row without any)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return (positions * (mask > 0)).amax(dim=1)


class RewardModelObjective(PairwiseObjective):
    """``-mean log σ(r⁺-r⁻) + z_loss·mean(r⁺²+r⁻²)``; the model ends in ``rm_linear`` (one output)."""

    def loss(self, engine: Engine, b: SequenceBatch) -> tuple[torch.Tensor, Metrics]:
        """The reward-model loss and its accuracy metrics."""
        scores = engine(b.inputs)[..., 0].float()  # [2b, s]
        rewards = scores.gather(1, last_trained_position(b.mask).unsqueeze(1)).squeeze(1)
        chosen, rejected = rewards.chunk(2)
        return rm_loss(chosen, rejected, self.cfg.z_loss)


class KTOObjective:
    """KTO on ``text``/``label`` streams with a ``reward`` stream (reward > 0: desirable, < 0: undesirable, 0: no
    weight)."""

    def __init__(self, cfg: PostTrainingConfig, eod: int, reference: torch.nn.Module | None) -> None:
        self.cfg, self.eod, self.reference = cfg, eod, reference

    def batch(self, data: dict[str, torch.Tensor] | None) -> SequenceBatch:
        """Token/label streams broadcast as int64, the reward stream as float32."""
        d = _broadcast(data, ["text", "label"], torch.int64)
        reward = kto_reward_rows(_broadcast(data, ["reward"], torch.float32)["reward"])
        b = sequence_batch(d["text"], d["label"], self.eod, self.cfg.eod_mask_loss)
        b.reward = reward
        if self.cfg.reads_precomputed_reference:
            b.reference = precomputed_reference(data, ["ref"])
        return b

    def _logprobs(self, model: Any, b: SequenceBatch) -> torch.Tensor:
        """Masked per-token log-probs ``[n, s]``."""
        return token_logprobs(model(b.inputs), b.targets, self.cfg.kto_fp32) * b.mask

    def loss(self, engine: Engine, b: SequenceBatch) -> tuple[torch.Tensor, Metrics]:
        """The KTO loss; each half's KL reference point comes from the other half of the micro-batch."""
        policy = self._logprobs(engine, b)
        if b.reference is not None:
            ref = b.reference * b.mask
        else:
            assert self.reference is not None, "KTO needs a reference model or precomputed reference log-probs"
            with torch.no_grad():
                ref = self._logprobs(self.reference, b)
        assert b.reward is not None
        return kto_loss(
            policy,
            ref,
            b.reward,
            b.mask,
            self.cfg.kto_beta,
            self.cfg.kto_desirable_weight,
            self.cfg.kto_undesirable_weight,
        )
