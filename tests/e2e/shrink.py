"""Shrink a real GPT-NeoX config to a CPU-sized run while keeping every other key.

Only the model size (layers, width, heads, MLP width), sequence length, batch, parallel sizes (world ≤ 4),
iterations (the extra_save_iters past them dropped; with the fp16 dynamic loss scale starting where a long run's has come down to) and file paths (data,
tokenizer, output folders) change; pipeline vs. sequential, ZeRO, precision,
optimizer, schedule, fusions, attention types, activation checkpointing and DeepSpeed's own settings stay.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from megatron.neox_arguments import KNOWN_KEYS
from megatron.neox_arguments.derive import expand_attention_config
from megatron.neox_arguments.loader import merge_config_files
from megatron.neox_arguments.sparse_layouts import SPARSE_TYPES

ITERS = 3
SEQ = 32
HIDDEN = 64
HEADS = 4

# keys that name files or folders: replaced by the test's own (or dropped)
DATA_KEYS = ("data_path", "train_data_paths", "valid_data_paths", "test_data_paths")
DROPPED = (
    "train_data_weights",
    "valid_data_weights",
    "test_data_weights",
    "label_data_paths",
    "train_label_data_paths",
    "valid_label_data_paths",
    "test_label_data_paths",
    "train_batch_size",
    "save",
    "load",
    "finetune",
    "iteration",
    "hostfile",
    "include",
    "exclude",
    "num_gpus",
    "global_num_gpus",
    "num_nodes",
    "master_port",
    "master_addr",
    "launcher",
    "deepspeed_slurm",
    "deepspeed_mpi",
    "sample_input_file",
    "sample_output_file",
    "wandb_host",
    "wandb_team",
    "tensorboard_dir",
    "log_dir",
    "lr_decay_iters",
    "train_epochs",
)


def load_raw(paths: list[Path]) -> dict[str, Any]:
    """The merged top-level keys of ``paths`` (canonical spellings), without resolving them."""
    return dict(merge_config_files([str(p) for p in paths], KNOWN_KEYS).values)


def _shrink_parallel(size: Any) -> int:
    size = int(size or 0)
    return min(size, 2)


def shrink(raw: dict[str, Any], files: dict[str, str], out_dir: Path) -> tuple[dict[str, Any], int]:
    """``(config, world)``: ``raw`` shrunk as described above; ``files`` holds the test's data/tokenizer paths."""
    cfg = copy.deepcopy(raw)
    for key in DROPPED:
        cfg.pop(key, None)
    for key in DATA_KEYS:
        if key in cfg:
            cfg[key] = files["data_path"] if key == "data_path" else [files["data_path"]]
    if not any(k in cfg for k in DATA_KEYS):
        cfg["data_path"] = files["data_path"]
    _shrink_tokenizer(cfg, files)

    layers = int(cfg.get("num_layers") or 2)
    types = expand_attention_config(cfg["attention_config"], layers) if cfg.get("attention_config") else None
    distinct = list(dict.fromkeys(types)) if types else []
    cfg["num_layers"] = max(2, len(distinct))
    if types:
        chosen = distinct + [distinct[-1]] * (cfg["num_layers"] - len(distinct))
        cfg["attention_config"] = [[[t], 1] for t in chosen]

    heads = int(cfg.get("num_attention_heads") or HEADS)
    kv = cfg.get("num_kv_heads")
    cfg["hidden_size"], cfg["num_attention_heads"] = HIDDEN, HEADS
    if kv is not None and int(kv) < heads:  # keep grouped-query (or multi-query) attention
        cfg["num_kv_heads"] = 1 if int(kv) == 1 else 2
    if cfg.get("intermediate_size"):
        cfg["intermediate_size"] = 176 if cfg.get("activation") == "swiglu" else 4 * HIDDEN
    cfg["seq_length"] = SEQ
    cfg["max_position_embeddings"] = SEQ
    if cfg.get("sliding_window_width"):
        cfg["sliding_window_width"] = SEQ // 2
    if set(types or ()) & set(SPARSE_TYPES):
        cfg["sparsity_config"] = shrink_sparsity(cfg.get("sparsity_config") or {})

    cfg["model_parallel_size"] = _shrink_parallel(cfg.get("model_parallel_size", 1)) or 1
    if "pipe_parallel_size" in cfg:
        cfg["pipe_parallel_size"] = _shrink_parallel(cfg["pipe_parallel_size"])
    pp = int(cfg.get("pipe_parallel_size") or 0)
    world = cfg["model_parallel_size"] * max(pp, 1)

    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["gradient_accumulation_steps"] = min(int(cfg.get("gradient_accumulation_steps") or 1), 2)
    cfg["train_iters"] = ITERS
    if cfg.get("extra_save_iters"):  # the iterations shrink, and with them the saves a run can reach
        cfg["extra_save_iters"] = [i for i in cfg["extra_save_iters"] if i <= ITERS]
    cfg["eval_interval"] = ITERS
    cfg["eval_iters"] = 1
    cfg["log_interval"] = 1
    if "checkpoint_factor" in cfg:
        cfg["checkpoint_factor"] = ITERS
    fp16 = cfg.get("fp16")
    if isinstance(fp16, dict) and fp16.get("enabled") and not fp16.get("loss_scale"):
        # a long run's dynamic loss scale has come down from 2^32 after its first overflow-skipped steps; start
        # there, so that 3 steps also run the optimizer
        cfg["fp16"] = {**fp16, "initial_scale_power": min(int(fp16.get("initial_scale_power", 32)), 12)}
    cfg["global_num_gpus"] = world
    cfg["use_wandb"] = False
    cfg["split"] = "90,5,5"
    if cfg.get("use_tensorboard") or "tensorboard_dir" in raw:
        cfg["tensorboard_dir"] = str(out_dir / "tb")
    return cfg, world


def shrink_sparsity(sparsity: dict[str, Any]) -> dict[str, Any]:
    """Blocks of SEQ / 8 tokens, and every block count at most half of the 8 blocks (the layouts stay sparse)."""
    out = {**sparsity, "block": min(int(sparsity.get("block", 16)), SEQ // 8)}
    half = SEQ // out["block"] // 2
    for key in ("num_local_blocks", "num_sliding_window_blocks", "num_random_blocks", "num_global_blocks"):
        if key in out:
            out[key] = min(out[key], half)
    if "local_window_blocks" in out:
        out["local_window_blocks"] = [min(w, half) for w in out["local_window_blocks"]]
    local, glob = out.get("num_local_blocks", 4), out.get("num_global_blocks", 1)
    if local % glob:
        out["num_global_blocks"] = 1
    if "num_different_global_patterns" in out:
        out["num_different_global_patterns"] = min(
            out["num_different_global_patterns"], local // out.get("num_global_blocks", 1)
        )
    return out


def _shrink_tokenizer(cfg: dict[str, Any], files: dict[str, str]) -> None:
    kind = cfg.get("tokenizer_type", "GPT2BPETokenizer")
    cfg["vocab_file"] = {
        "HFTokenizer": files["hf_tokenizer"],
        "HFGPT2Tokenizer": files["hf_tokenizer"],
        "SPMTokenizer": files["spm_model"],
        "GPT2BPETokenizer": files["gpt2_vocab"],
    }.get(kind, cfg.get("vocab_file"))
    if kind == "GPT2BPETokenizer":
        cfg["merge_file"] = files["gpt2_merges"]
    else:
        cfg.pop("merge_file", None)
