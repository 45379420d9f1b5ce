"""The post-training keys of a GPT-NeoX config, read once (``train_impl``, ``dpo_*``, ``kto_*``, ``z_loss``, data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.config_utils import neox_overrides

SPLITS = ("train", "valid", "test")
PAIRWISE_IMPLS = ("dpo", "rm")


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
    def from_neox_args(cls, args: Any) -> PostTrainingConfig:
        """Read the flat GPT-NeoX attribute names."""
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


def post_training_problems(v: dict[str, Any]) -> list[str]:
    """Cross-key rules of post-training configs (run by ``validate()`` with the other rules)."""
    out: list[str] = []
    impl, pairwise = v["train_impl"], v["dataset_impl"] == "pairwise"
    if impl in PAIRWISE_IMPLS and not pairwise:
        out.append(f"train_impl: {impl} needs dataset_impl: pairwise (chosen/rejected pairs)")
    if pairwise and impl not in PAIRWISE_IMPLS:
        out.append(f"dataset_impl: pairwise is read by train_impl dpo or rm, not {impl!r}")
    if pairwise or impl == "kto":
        if v["pack_impl"] != "unpacked":
            out.append(f"train_impl: {impl} reads one document per sample: set pack_impl: unpacked")
        if v["train_epochs"] is not None:
            out.append(f"train_impl: {impl} needs train_iters (train_epochs is for packed language-model data)")
    if pairwise:
        for split in SPLITS:
            pos, neg = v[f"pos_{split}_data_paths"], v[f"neg_{split}_data_paths"]
            if (pos is None) != (neg is None) or (pos and len(pos) != len(neg)):
                out.append(f"pos_{split}_data_paths and neg_{split}_data_paths need the same number of entries")
            for side, paths in (("pos", pos), ("neg", neg)):
                labels = v[f"{side}_{split}_label_data_paths"]
                if labels is not None and (paths is None or len(labels) != len(paths)):
                    out.append(f"{side}_{split}_label_data_paths needs one entry per {side}_{split}_data_paths entry")
        if not v["pos_train_data_paths"]:
            out.append(f"train_impl: {impl} needs pos_train_data_paths and neg_train_data_paths (chosen/rejected data)")
        if v["data_path"] or v["train_data_paths"]:
            out.append("dataset_impl: pairwise reads pos_/neg_*_data_paths; remove data_path/train_data_paths")
    if impl == "kto" and not v["train_reward_data_paths"]:
        out.append(
            "train_impl: kto needs train_reward_data_paths (one reward stream per train_data_paths entry, written by "
            "preprocess_data_with_chat_template.py --reward-key)"
        )
    if impl != "kto" and any(v[f"{s}_reward_data_paths"] for s in SPLITS):
        out.append("*_reward_data_paths are read by train_impl: kto only")
    if impl == "rm" and v["sequence_parallel"]:
        out.append("train_impl: rm does not support sequence_parallel yet")
    return out
