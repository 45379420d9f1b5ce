"""Cross-key rules of post-training configs (``train_impl`` dpo/kto/rm/reinforce, pairwise, reward and online data), run by
``validate()`` with the other rules; the keys are read by ``megatron.post_training.config``."""

from __future__ import annotations

from typing import Any

SPLITS = ("train", "valid", "test")
PAIRWISE_IMPLS = ("dpo", "rm")


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
    out += _reinforce_problems(v)
    if impl == "rm" and v["sequence_parallel"]:
        out.append("train_impl: rm does not support sequence_parallel yet")
    return out


def _reinforce_problems(v: dict[str, Any]) -> list[str]:
    """``train_impl: reinforce`` reads rollouts from online data servers (``dataset_impl: online``) and nothing else."""
    out: list[str] = []
    impl, online = v["train_impl"], v["dataset_impl"] == "online"
    if impl == "reinforce" and not online:
        out.append("train_impl: reinforce needs dataset_impl: online (rollouts from online_dataserver_ips/ports)")
    if online and impl != "reinforce":
        out.append(f"dataset_impl: online is read by train_impl: reinforce, not {impl!r}")
    ips, ports = v["online_dataserver_ips"], v["online_dataserver_ports"]
    if isinstance(ips, list) and isinstance(ports, list) and len(ips) != len(ports):
        out.append(
            f"online_dataserver_ips has {len(ips)} entries but online_dataserver_ports has {len(ports)}: give one "
            "host and port per data-parallel rank (or a single value for all)"
        )
    for key in ("online_dataserver_ips", "online_dataserver_ports", "weight_server_port"):
        if isinstance(v[key], list) and not v[key]:
            out.append(f"{key} is an empty list: give one value, or one per rank")
    return out
