"""The post-training keys of a GPT-NeoX config, read once (``train_impl``, ``dpo_*``, ``kto_*``, ``z_loss``, data).

Their cross-key rules live with the other config rules: ``megatron.neox_arguments.post_training_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config_utils import NeoXValues, neox_overrides


@dataclass
class PostTrainingConfig:
    """Objective and its coefficients; data stream prefixes per split for pairwise (DPO/RM) and KTO data."""

    train_impl: str = "normal"
    dataset_impl: str = "gpt2"
    dpo_beta: float = 0.1
    dpo_fp32: bool = True
    dpo_reference_free: bool = False
    kto_beta: float = 0.1
    kto_fp32: bool = True
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    z_loss: float = 0.0
    eod_mask_loss: bool = False
    precompute_model_name: str | None = None
    pos_train_data_paths: list[str] | None = None
    neg_train_data_paths: list[str] | None = None
    pos_train_label_data_paths: list[str] | None = None
    neg_train_label_data_paths: list[str] | None = None
    pos_valid_data_paths: list[str] | None = None
    neg_valid_data_paths: list[str] | None = None
    pos_valid_label_data_paths: list[str] | None = None
    neg_valid_label_data_paths: list[str] | None = None
    pos_test_data_paths: list[str] | None = None
    neg_test_data_paths: list[str] | None = None
    pos_test_label_data_paths: list[str] | None = None
    neg_test_label_data_paths: list[str] | None = None
    train_reward_data_paths: list[str] | None = None
    valid_reward_data_paths: list[str] | None = None
    test_reward_data_paths: list[str] | None = None

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
