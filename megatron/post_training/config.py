"""The post-training keys of a GPT-NeoX config, read once (``train_impl``, ``dpo_*``, ``kto_*``, ``z_loss``, REINFORCE, data).

Their cross-key rules live with the other config rules: ``megatron.neox_arguments.post_training_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config_utils import NeoXValues, neox_overrides
from megatron.neox_arguments.sections.other import LossMaskKeys
from megatron.neox_arguments.sections.textgen import PrecomputeKeys
from megatron.neox_arguments.sections.training import (
    PairedDataPathKeys,
    PostTrainingKeys,
    ReinforceKeys,
    TrainImplKeys,
)


@dataclass
class PostTrainingConfig(
    PostTrainingKeys, TrainImplKeys, LossMaskKeys, PrecomputeKeys, PairedDataPathKeys, ReinforceKeys
):
    """Objective and its coefficients; data stream prefixes per split for pairwise (DPO/RM) and KTO data; the
    online (REINFORCE) data servers."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> PostTrainingConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        return cls(**neox_overrides(cls, args))

    @property
    def pairwise(self) -> bool:
        """Chosen/rejected pair data (``dataset_impl: pairwise``)."""
        return self.dataset_impl == "pairwise"

    @property
    def reads_precomputed_reference(self) -> bool:
        """DPO/KTO with ``precompute_model_name``: reference log-probs come from the files ``text_gen_type:
        precompute`` wrote (``<prefix>_<precompute_model_name>``), not from a frozen copy of the model."""
        reference_free = self.train_impl == "dpo" and self.dpo_reference_free
        return bool(self.precompute_model_name) and self.train_impl in ("dpo", "kto") and not reference_free

    def paths(self, split: str, stream: str) -> list[str] | None:
        """Prefixes of one stream (``pos``, ``neg``, ``pos_label``, ``neg_label``, ``reward``) of a split."""
        if stream == "reward":
            return getattr(self, f"{split}_reward_data_paths")
        side, _, label = stream.partition("_")
        return getattr(self, f"{side}_{split}_{label + '_' if label else ''}data_paths")
