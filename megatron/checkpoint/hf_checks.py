"""Checks on a Hugging Face folder handed to the importer, before anything is converted or written.

A HF folder from elsewhere is data: its ``config.json`` must be a JSON object that needs no custom code
(``auto_map`` is never followed: transformers is called with ``trust_remote_code=False``, so no prompt can run the
folder's Python), its safetensors headers must be well formed and its sharded index must name files inside the
folder. Its config's sizes must agree with the weight shapes and its tokenizer must fit the embedding rows; each
problem is one line naming the file, key or tensor and what would be valid.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.layout import CheckpointError, confined
from megatron.model.config import GPTModelConfig

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on the JSON header
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size")  # fmt: skip
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; one-line errors for unreadable, non-JSON or non-object content."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def refuse_custom_code(path: Path, what: str) -> None:
    """``path`` (a ``config.json`` / ``tokenizer_config.json``) must not ask for the folder's own Python code."""
    if not path.is_file():
        return
    auto_map = read_json_object(path).get("auto_map")
    if auto_map:
        targets = sorted({str(v) for v in (auto_map.values() if isinstance(auto_map, dict) else [auto_map])})
        raise CheckpointError(
            f"{path}: auto_map names custom code ({', '.join(targets)[:200]}); neox-forge reads only weights and "
            f"never runs a {what} folder's Python. Use a folder of a built-in architecture without auto_map"
        )


def check_safetensors(path: Path) -> None:
    """The safetensors header of ``path``: an 8-byte length, a JSON object of that length, tensor offsets inside the
    file. Catches truncated files and corrupt headers with a one-line error instead of a library traceback."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, shorter than its 8-byte header")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(
                f"{path}: safetensors header length {length} exceeds the file ({size} bytes) or the format's limit "
                f"of {MAX_HEADER_BYTES} bytes (truncated or corrupt file)"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header must be a JSON object, not {type(header).__name__}")
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{path}: safetensors header entry {name!r} has no valid data_offsets")
        if not 0 <= offsets[0] <= offsets[1] <= data:
            raise CheckpointError(
                f"{path}: tensor {name!r} lies at bytes {offsets[0]}..{offsets[1]} but the file holds {data} data "
                "bytes (truncated file?)"
            )


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checked safetensors file; any remaining format error is one line naming the file."""
    from safetensors.torch import load_file

    check_safetensors(path)
    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError (dtype/shape/offset inconsistencies) has no public base class
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None


def index_files(index: Path, hf_dir: Path) -> list[str]:
    """The shard files a ``*.index.json`` names: its ``weight_map`` must map tensor names to files in ``hf_dir``."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        got = "missing" if weight_map is None else f"a {type(weight_map).__name__}"
        raise CheckpointError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file, got {got}")
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise CheckpointError(f"{index}: weight_map[{bad[0]!r}] = {bad[1]!r} is not a shard file name")
    files = sorted(set(weight_map.values()))
    for name in files:
        confined(hf_dir, name, f"{index} weight_map")
    return files


def expected_hf_shapes(cfg: GPTModelConfig, arch: str) -> dict[str, tuple[int, ...]]:
    """HF tensor name → shape the config implies (built on the meta device: no memory, no weights)."""
    from megatron.checkpoint.reader import full_shapes
    from megatron.model.hf_mapping import neox_to_hf_state_dict
    from megatron.model.moe.hf_mixtral import mixtral_disk_names

    meta = {k: torch.empty(s, device="meta") for k, s in full_shapes(cfg).items()}
    hf = neox_to_hf_state_dict(meta, cfg, arch)
    if arch == "mixtral":
        hf.update(mixtral_disk_names(hf))  # both the fused and the per-expert names are read
    if "lm_head.weight" in hf:
        hf["embed_out.weight"] = hf["lm_head.weight"]  # HF GPTNeoX's on-disk name of the head
    return {k: tuple(v.shape) for k, v in hf.items()}


def check_weights_against_config(
    weights: dict[str, torch.Tensor], cfg: GPTModelConfig, arch: str, config_json: Path, hf_config: Any
) -> None:
    """The weight shapes and the number of layers must be what ``config.json`` says."""
    sizes = ", ".join(f"{k}={getattr(hf_config, k)}" for k in SIZE_KEYS if getattr(hf_config, k, None) is not None)
    layers = {int(m.group(1)) for name in weights if (m := _LAYER_RE.search(name))}
    if layers and max(layers) + 1 != cfg.num_layers:
        raise CheckpointError(
            f"{config_json.parent}: the weights hold layers 0..{max(layers)} but {config_json} says "
            f"num_hidden_layers={cfg.num_layers}"
        )
    expected = expected_hf_shapes(cfg, arch)
    for name, tensor in sorted(weights.items()):
        want = expected.get(name)
        if want is not None and tuple(tensor.shape) != want:
            raise CheckpointError(
                f"{config_json.parent}: tensor {name} has shape {tuple(tensor.shape)} but {config_json} ({sizes}) "
                f"implies {want}"
            )


def check_tokenizer_fits(hf_dir: Path, vocab_size: int) -> None:
    """A ``tokenizer.json`` may not produce ids beyond the model's ``vocab_size`` embedding rows."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return
    from tokenizers import Tokenizer

    try:
        tokens = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if tokens > vocab_size:
        raise CheckpointError(
            f"{path} has {tokens} tokens but {hf_dir / 'config.json'} says vocab_size={vocab_size}: ids >= "
            f"{vocab_size} would have no embedding row (expected a tokenizer of at most {vocab_size} tokens)"
        )
