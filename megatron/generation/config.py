"""The config keys generation, precompute and the inference setup read (``generate.py``, ``eval.py``).

Built once from the validated arguments at the entry (``InferenceConfig.from_neox_args(args)``); everything below
takes these values, and nothing writes back into the argument object: the padded vocabulary of the model that runs
is the checkpoint's (``megatron.checkpoint.reader`` reads it), not a value stored into the arguments.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

from megatron.checkpoint import model_config as checkpoint_model_config
from megatron.config_utils import NeoXValues, neox_values
from megatron.generation.sampling import SamplingConfig
from megatron.initialize import InitConfig
from megatron.model.config import GPTModelConfig
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.s3_checks import is_s3_url
from megatron.neox_arguments.sections.deepspeed import BatchSizeKeys
from megatron.neox_arguments.sections.model import SequenceKeys
from megatron.neox_arguments.sections.other import LoadIterationKeys, ParallelSizeKeys, SeedKeys
from megatron.neox_arguments.sections.textgen import GenerationKeys, PrecomputeKeys
from megatron.neox_arguments.sections.training import DataPathKeys, LoadSaveKeys, PairedDataPathKeys
from megatron.tokenizer import TokenizerConfig

# GPT-NeoX's order of the dataset groups precompute scores: train/test/valid, else pairwise pos/neg, else data_path
PRECOMPUTE_GROUPS: tuple[tuple[str, ...], ...] = (
    ("train_data_paths", "test_data_paths", "valid_data_paths"),
    tuple(f"{kind}_{split}_data_paths" for split in ("train", "valid", "test") for kind in ("pos", "neg")),
    ("data_path",),
)


@dataclass
class PrecomputeConfig(PrecomputeKeys, LoadSaveKeys, SequenceKeys, BatchSizeKeys, DataPathKeys, PairedDataPathKeys):
    """``text_gen_type: precompute``: which datasets to score and what to call the outputs (GPT-NeoX keys)."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> PrecomputeConfig:
        """Read every field strictly under its NeoX key (values as set, ``None`` included)."""
        return cls(**neox_values(cls, args))

    @property
    def model_name(self) -> str:
        """``precompute_model_name``, else a stable signed 64-bit hash of ``load`` (like ``str(hash(...))``)."""
        if self.precompute_model_name:
            return str(self.precompute_model_name)
        digest = hashlib.sha256(str(self.load).encode("utf-8")).digest()[:8]
        return str(int.from_bytes(digest, "little", signed=True))

    def paths(self) -> list[str]:
        """The dataset prefixes to score, in GPT-NeoX's order."""
        if self.train_data_paths:
            groups = PRECOMPUTE_GROUPS[0]
        elif self.pos_train_data_paths:
            groups = PRECOMPUTE_GROUPS[1]
        else:
            groups = PRECOMPUTE_GROUPS[2]
        paths: list[str] = []
        for key in groups:
            value = getattr(self, key)
            paths += [value] if isinstance(value, str) else list(value or [])
        if not paths:
            raise ValueError("text_gen_type precompute needs data: set train_data_paths (or data_path)")
        return paths


@dataclass(kw_only=True)  # the nested module configs have no default
class InferenceConfig(LoadSaveKeys, LoadIterationKeys, SeedKeys, ParallelSizeKeys, GenerationKeys):
    """What loading a checkpoint for inference and ``text_gen_type`` need (GPT-NeoX keys), with the module configs
    of the tokenizer, the sampler, precompute and process start-up."""

    tokenizer: TokenizerConfig
    sampling: SamplingConfig
    precompute: PrecomputeConfig
    init: InitConfig
    model_for: Callable[[int], GPTModelConfig] | None = None
    """The model config for a padded vocabulary size (the checkpoint's), from the run's model keys."""

    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("tokenizer", "sampling", "precompute", "init", "model_for")

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> InferenceConfig:
        """Read every field strictly under its NeoX key, and the nested module configs from the same arguments."""
        # a plain snapshot of every key: the model config is built from it for the checkpoint's vocabulary
        every_key = SimpleNamespace(**(args.to_dict() if isinstance(args, NeoXArgs) else vars(args)))
        return cls(
            **neox_values(cls, args),
            tokenizer=TokenizerConfig.from_neox_args(args),
            sampling=SamplingConfig.from_neox_args(args),
            precompute=PrecomputeConfig.from_neox_args(args),
            init=InitConfig.from_neox_args(args),
            model_for=functools.partial(checkpoint_model_config, every_key),
        )

    @property
    def checkpoint_dir(self) -> str:
        """The checkpoint to load: ``load`` (``auto``: ``save``)."""
        load = self.save if self.load == "auto" else self.load
        if not load:
            raise ConfigError("load: generation needs the checkpoint directory to load")
        if is_s3_url(load):
            raise ConfigError(
                f"load={load!r}: generation and evaluation read a local checkpoint folder; an s3:// location is "
                "downloaded by training runs only (into s3_cache_dir): load that folder, or download the checkpoint"
            )
        return str(load)

    def output_path(self) -> str:
        """``sample_output_file``; unset (null): ``<sample_input_file>.output.jsonl`` for input-file (GPT-NeoX),
        else ``samples.txt``."""
        if self.sample_output_file:
            return self.sample_output_file
        if self.text_gen_type == "input-file":
            return f"{self.sample_input_file}.output.jsonl"
        return "samples.txt"

    def model_config(self, padded_vocab_size: int) -> GPTModelConfig:
        """The run's model config for ``padded_vocab_size``."""
        if self.model_for is None:
            raise ValueError("InferenceConfig has no model keys: build it with InferenceConfig.from_neox_args")
        return self.model_for(padded_vocab_size)
