"""Hugging Face folders ⟷ full GPT-NeoX state dicts (GPTNeoX / Llama / Mistral).

Export writes ``config.json`` (transformers 5.x fields), ``model.safetensors`` and, when the config names a
tokenizer that has a Hugging Face form, the tokenizer files; ``AutoModelForCausalLM`` / ``AutoTokenizer`` load the
folder. Import reads only safetensors or ``weights_only`` torch files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron.checkpoint import hf_checks
from megatron.checkpoint.hf_config_checks import check_hf_config
from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load
from megatron.checkpoint.writer import staged_output
from megatron.config_utils import not_neox_keys
from megatron.model.config import FUSION_KEYS, GPTModelConfig
from megatron.model.hf_mapping import hf_config_to_neox, hf_to_neox_state_dict, neox_to_hf_config, neox_to_hf_state_dict
from megatron.model.moe.hf_mixtral import mixtral_disk_names
from megatron.neox_arguments.namespace import default_values
from megatron.neox_arguments.precision import dtype_of_precision
from megatron.neox_arguments.unsupported import UNSUPPORTED_KEYS
from megatron.tokenizer import TokenizerConfig, build_tokenizer

logger = logging.getLogger(__name__)

HF_PRECISIONS = ("fp16", "bf16", "fp32")  # the converters' --precision choices (besides auto)
EOD_TOKEN = "<|endoftext|>"


def resolve_precision(precision: str, cfg: GPTModelConfig) -> torch.dtype:
    """``auto`` = the model's own ``precision``; else fp16 / bf16 / fp32."""
    if precision == "auto":
        return cfg.params_dtype
    if precision not in HF_PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of auto, {', '.join(HF_PRECISIONS)}")
    return dtype_of_precision(precision)


# ---------------------------------------------------------------------------------------------------------------
# export


def file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (0644 under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def hf_tokenizer(config: TokenizerConfig, vocab_is_hf_tokenizer: bool = False) -> Any | None:
    """A ``PreTrainedTokenizerFast`` for the config's tokenizer, or None when it has no Hugging Face form."""
    kind, vocab_file = config.tokenizer_type, config.vocab_file
    if vocab_is_hf_tokenizer:
        if not vocab_file or not Path(vocab_file).exists():
            raise CheckpointError(f"--vocab-is-hf-tokenizer: vocab_file {vocab_file!r} does not exist")
        if Path(vocab_file).is_dir():
            from megatron.tokenizer.tokenizer import auto_tokenizer

            try:
                return auto_tokenizer(str(vocab_file))  # trust_remote_code=False; auto_map refused
            except ValueError as e:
                raise CheckpointError(f"--vocab-is-hf-tokenizer: {e}") from None
        from tokenizers import Tokenizer

        return _fast_tokenizer(Tokenizer.from_file(str(vocab_file)))
    if kind.lower() in ("hftokenizer", "gpt2bpetokenizer", "hfgpt2tokenizer"):
        missing = [f for f in (vocab_file, config.merge_file) if f and not Path(f).exists()]
        if not vocab_file or missing:
            what = f"{missing[0]} does not exist" if missing else "the config names no vocab_file"
            logger.warning("%s tokenizer: %s; no tokenizer files written", kind, what)
            return None

        tok: Any = build_tokenizer(config)  # these kinds wrap an HF .tokenizer
        if kind.lower() == "hfgpt2tokenizer":
            return tok.tokenizer
        fast = _fast_tokenizer(tok.tokenizer)
        template = chat_template_beside(Path(vocab_file))
        if template is not None:
            fast.chat_template = template
        return fast
    logger.warning("tokenizer_type %r has no Hugging Face tokenizer form: no tokenizer files written", kind or None)
    return None


def _fast_tokenizer(tokenizer: Any) -> Any:
    """``PreTrainedTokenizerFast`` around a ``tokenizers.Tokenizer`` with GPT-NeoX's special tokens when present."""
    from transformers import PreTrainedTokenizerFast

    special = {}
    if tokenizer.token_to_id(EOD_TOKEN) is not None:
        special = {"eos_token": EOD_TOKEN, "bos_token": EOD_TOKEN, "unk_token": EOD_TOKEN}
    if tokenizer.token_to_id("<|padding|>") is not None:
        special["pad_token"] = "<|padding|>"
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)


def export_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: GPTModelConfig,
    output_dir: str | Path,
    *,
    architecture: str = "neox",
    precision: str = "auto",
    tokenizer: Any = None,
    pad_token_id: int | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a Hugging Face folder for the full NeoX ``state_dict``; returns ``output_dir``."""
    from safetensors.torch import save_file

    dtype = resolve_precision(precision, cfg)
    extra: dict[str, Any] = {}
    if pad_token_id is not None:
        extra["pad_token_id"] = pad_token_id
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        extra.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
        if pad_token_id is None and tokenizer.pad_token_id is not None:
            extra["pad_token_id"] = tokenizer.pad_token_id
    try:
        hf_config = neox_to_hf_config(cfg, architecture, **extra)
        hf_sd = neox_to_hf_state_dict(state_dict, cfg, architecture)
    except ValueError as e:
        raise CheckpointError(f"cannot export to {architecture}: {e}") from None
    hf_config.dtype = dtype
    if "score.weight" in hf_sd:  # reward model: one score per sequence, read at the last non-pad token
        hf_config.architectures = [hf_config.architectures[0].replace("ForCausalLM", "ForSequenceClassification")]
        hf_config.num_labels = 1
    if cfg.tied_embeddings:
        hf_sd.pop("lm_head.weight", None)  # tied: HF re-ties it to the input embedding on load
    if architecture == "mixtral":
        hf_sd = mixtral_disk_names(hf_sd)  # the per-expert names HF itself writes (and other tools read)
    tensors = {}
    for name, tensor in hf_sd.items():
        tensors[name] = tensor.detach().to(dtype).contiguous().clone()
        if progress:
            progress(name)
    with staged_output(output_dir, overwrite) as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "model.safetensors").chmod(file_mode())  # safetensors writes 0600 whatever the umask
        hf_config.save_pretrained(str(staging))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
    logger.info("wrote %s (%s, %s, %d tensors)", output_dir, hf_config.architectures[0], dtype, len(tensors))
    return Path(output_dir)


# ---------------------------------------------------------------------------------------------------------------
# import


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        return safe_torch_load(path)
    except UnsafeCheckpointError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # truncated or not a torch file
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None


def read_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder: (sharded) safetensors, else (sharded) ``pytorch_model.bin`` (weights_only)."""
    hf_dir = Path(hf_dir)
    for index_name, loader in (
        ("model.safetensors.index.json", hf_checks.load_safetensors),
        ("pytorch_model.bin.index.json", _load_bin),
    ):
        index = hf_dir / index_name
        if index.is_file():
            out: dict[str, torch.Tensor] = {}
            for name in hf_checks.index_files(index, hf_dir):
                if not (hf_dir / name).is_file():
                    raise CheckpointError(f"{index} lists {name} but {hf_dir / name} is missing")
                out.update(loader(hf_dir / name))
            return out
    if (hf_dir / "model.safetensors").is_file():
        return hf_checks.load_safetensors(hf_dir / "model.safetensors")
    if (hf_dir / "pytorch_model.bin").is_file():
        return _load_bin(hf_dir / "pytorch_model.bin")
    raise CheckpointError(f"{hf_dir} has no model.safetensors, pytorch_model.bin or their sharded index")


def import_hf(hf_dir: str | Path, precision: str = "auto") -> tuple[dict[str, torch.Tensor], GPTModelConfig, str, Any]:
    """``(full NeoX state dict, GPTModelConfig, architecture, HF config)`` of a local HF folder."""
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    config_json = hf_dir / "config.json"
    if not config_json.is_file():
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    hf_checks.refuse_custom_code(config_json, "model")
    check_hf_config(config_json, hf_checks.read_json_object(config_json))
    try:
        hf_config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as e:  # transformers' errors for configs it cannot read
        raise CheckpointError(f"{config_json}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    try:
        cfg, arch = hf_config_to_neox(hf_config)
    except (ValueError, TypeError, AttributeError) as e:  # a field of the wrong type or missing
        raise CheckpointError(f"{config_json}: {e}") from None
    hf_checks.check_tokenizer_fits(hf_dir, cfg.vocab_rows)
    weights = read_hf_weights(hf_dir)
    hf_checks.check_weights_against_config(weights, cfg, arch, config_json, hf_config)
    stored = next(iter(weights.values())).dtype if weights else torch.float32
    dtype = stored if precision == "auto" else resolve_precision(precision, cfg)
    cfg = cfg.replace(params_dtype=dtype)
    try:
        sd = hf_to_neox_state_dict(weights, cfg, arch)
    except ValueError as e:
        raise CheckpointError(f"{hf_dir}: {e}") from None
    return {k: v.to(dtype) for k, v in sd.items()}, cfg, arch, hf_config


# GPTModelConfig fields that do not describe the converted checkpoint's architecture: how a run initialises, trains or
# executes the model (the user's setup file sets them), or written in another form (padded_vocab_size: as
# make_vocab_size_divisible_by, which is written from it). Every other field of the model config is written, so a new one cannot be forgotten.
RUN_KEYS = frozenset(
    {
        "padded_vocab_size",
        "make_vocab_size_divisible_by",
        "init_method",
        "output_layer_init_method",
        "seed",
        "sequence_parallel",
        "pipe_partition_method",
        "checkpoint_activations",
        "checkpoint_num_layers",
        "fp16_lm_cross_entropy",
        "attention_softmax_in_fp32",
        "apply_query_key_layer_scaling",
        "moe_lbl_in_fp32",
        "onnx_safe",
        "precision",
        "seq_length",
        "torch_compile",
        "use_cpu_initialization",
        "output_layer_parallelism",  # GPT-NeoX supports one value, column
    }
) | frozenset(FUSION_KEYS)  # kernel switches: the same computation, mapped to SDPA / torch ops
# The model keys of the YAML written next to a converted checkpoint (tests/unit/test_hf_model_keys.py loads it back).
MODEL_KEYS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(GPTModelConfig)
    if f.name not in RUN_KEYS and f.name not in not_neox_keys(GPTModelConfig)
)


def _attention_runs(layer_types: tuple[str, ...]) -> list[list[Any]]:
    """Per-layer attention types in GPT-NeoX's ``attention_config`` form: ``[[[type], count], ...]``."""
    runs: list[list[Any]] = []
    for kind in layer_types:
        if runs and runs[-1][0] == [kind]:
            runs[-1][1] += 1
        else:
            runs.append([[kind], 1])
    return runs


def neox_config_yaml(cfg: GPTModelConfig, tp: int, pp: int) -> str:
    """The GPT-NeoX YAML model section matching ``cfg`` (+ parallelism and vocabulary padding).

    ``make_vocab_size_divisible_by`` is ``padded_vocab_size / tp`` so that GPT-NeoX's padding rule reproduces the
    checkpoint's vocabulary rows for any tokenizer no larger than it.
    """
    values: dict[str, Any] = {key: getattr(cfg, key) for key in MODEL_KEYS}
    values["attention_config"] = _attention_runs(cfg.layer_types)
    values = {k: v for k, v in values.items() if v is not None and (cfg.is_moe or not k.startswith("moe_"))}
    # a key of a feature not supported yet, at its default, describes nothing of the checkpoint
    defaults = default_values()
    values = {k: v for k, v in values.items() if not (k in UNSUPPORTED_KEYS and v == defaults[k])}
    values.update(
        model_parallel_size=tp,
        pipe_parallel_size=pp,
        make_vocab_size_divisible_by=cfg.vocab_rows // tp,
    )
    header = "# Model keys of a checkpoint converted from Hugging Face by tools/ckpts/convert_hf_to_neox.py\n"
    return header + yaml.safe_dump(values, sort_keys=False)


def tokenizer_yaml(tokenizer_file: str) -> str:
    """The tokenizer keys for the copied HF ``tokenizer.json`` (a separate file: setup files often set them)."""
    header = "# Tokenizer of the converted Hugging Face model; use instead of the tokenizer keys of your setup file\n"
    return header + yaml.safe_dump({"tokenizer_type": "HFTokenizer", "vocab_file": tokenizer_file}, sort_keys=False)


class Vocabulary:
    """The vocabulary of a HF ``tokenizer.json`` as a training run's tokenizer exposes it (``vocab``, ``vocab_size``),
    for ``megatron.checkpoint.tokenizer_identity``."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise CheckpointError(f"cannot read {path}: {e}") from None
        self.vocab: dict[str, int] = tok.get_vocab()
        self.vocab_size = int(tok.get_vocab_size())


def hf_tokenizer_vocab(hf_dir: str | Path) -> Vocabulary:
    """The vocabulary of ``hf_dir/tokenizer.json``."""
    return Vocabulary(Path(hf_dir) / "tokenizer.json")


# What an HF tokenizer folder holds besides tokenizer.json; transformers 5 keeps the chat template in its own file
# (older versions in tokenizer_config.json), and named templates under additional_chat_templates/.
TOKENIZER_FOLDER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def tokenizer_files(hf_dir: str | Path) -> dict[str, str]:
    """``{"tokenizer/<name>": text}`` for the HF folder's ``tokenizer.json``, its configs and its chat templates
    (empty if it has no ``tokenizer.json``)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "tokenizer.json").is_file():
        return {}
    files = [hf_dir / n for n in TOKENIZER_FOLDER_FILES if (hf_dir / n).is_file()]
    files += sorted((hf_dir / "additional_chat_templates").glob("*.jinja"))
    return {f"tokenizer/{f.relative_to(hf_dir).as_posix()}": f.read_text(encoding="utf-8") for f in files}


def chat_template_beside(tokenizer_json: Path) -> str | None:
    """The chat template stored next to a ``tokenizer.json`` (``chat_template.jinja``, else the
    ``tokenizer_config.json`` string), or None: carried into an exported HF tokenizer."""
    folder = tokenizer_json.parent
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, AttributeError):
        return None  # not ours to judge here: the tokenizer itself was read from tokenizer.json
    return template if isinstance(template, str) else None
