"""The post-training keys of a GPT-NeoX config, read once (``train_impl``, ``dpo_*``, ``kto_*``, ``z_loss``, data).

Their cross-key rules live with the other config rules: ``megatron.neox_arguments.post_training_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config_utils import NeoXValues, from_schema, neox_overrides, schema_defaults
from megatron.neox_arguments.sections.training import DATASET_IMPLS, TRAIN_IMPLS


@dataclass
@schema_defaults
class PostTrainingConfig:
    """Objective and its coefficients; data stream prefixes per split for pairwise (DPO/RM) and KTO data."""

    train_impl: TRAIN_IMPLS = from_schema()
    dataset_impl: DATASET_IMPLS = from_schema()
    dpo_beta: float = from_schema()
    dpo_fp32: bool = from_schema()
    dpo_reference_free: bool = from_schema()
    kto_beta: float = from_schema()
    kto_fp32: bool = from_schema()
    kto_desirable_weight: float = from_schema()
    kto_undesirable_weight: float = from_schema()
    z_loss: float = from_schema()
    eod_mask_loss: bool = from_schema()
    precompute_model_name: str | None = from_schema()
    pos_train_data_paths: list | None = from_schema()
    neg_train_data_paths: list | None = from_schema()
    pos_train_label_data_paths: list | None = from_schema()
    neg_train_label_data_paths: list | None = from_schema()
    pos_valid_data_paths: list | None = from_schema()
    neg_valid_data_paths: list | None = from_schema()
    pos_valid_label_data_paths: list | None = from_schema()
    neg_valid_label_data_paths: list | None = from_schema()
    pos_test_data_paths: list | None = from_schema()
    neg_test_data_paths: list | None = from_schema()
    pos_test_label_data_paths: list | None = from_schema()
    neg_test_label_data_paths: list | None = from_schema()
    train_reward_data_paths: list | None = from_schema()
    valid_reward_data_paths: list | None = from_schema()
    test_reward_data_paths: list | None = from_schema()

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
