"""GPT-NeoX's ``NeoXArgs`` scripting API (names and signatures as in GPT-NeoX), over our sections.

GPT-NeoX's ``NeoXArgs`` is one dataclass inheriting from its section classes (``NeoXArgsModel``, ...); ours is a
facade over the section dataclasses of ``sections/``. This mixin gives scripts written against GPT-NeoX what they
call: ``get_deepspeed_main_args()`` (the worker command line that ``consume_neox_args`` reads back),
``megatron_config`` / ``all_config`` / ``deepspeed_runner``, ``validate_keys()``, ``__dataclass_fields__`` and
``build_tokenizer()``; and the section classes under GPT-NeoX's names.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from megatron.cluster.env_values import master_addr
from megatron.cluster.worker_env import launched_world_size
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.sections import (
    SECTIONS,
    DeepspeedConfigArgs,
    DeepspeedRunnerArgs,
    LoggingArgs,
    LRSchedulerArgs,
    ModelArgs,
    MoEArgs,
    OptimizerArgs,
    OtherArgs,
    ParallelismArgs,
    TextgenArgs,
    TokenizerArgs,
    TrainingArgs,
)

logger = logging.getLogger(__name__)

# GPT-NeoX's section class names (``megatron.neox_arguments.neox_args`` / ``.deepspeed_args``): the same dataclasses.
NeoXArgsParallelism = ParallelismArgs
NeoXArgsModel = ModelArgs
NeoXArgsMoE = MoEArgs
NeoXArgsOptimizer = OptimizerArgs
NeoXArgsLRScheduler = LRSchedulerArgs
NeoXArgsTokenizer = TokenizerArgs
NeoXArgsTraining = TrainingArgs
NeoXArgsLogging = LoggingArgs
NeoXArgsTextgen = TextgenArgs
NeoXArgsOther = OtherArgs
NeoXArgsDeepspeedConfig = DeepspeedConfigArgs
NeoXArgsDeepspeedRunner = DeepspeedRunnerArgs

_DEEPSPEED_SECTIONS = ("deepspeed_config", "deepspeed_runner")


def _all_fields() -> dict[str, dataclasses.Field]:
    out: dict[str, dataclasses.Field] = {}
    for cls in SECTIONS.values():
        out.update({f.name: f for f in dataclasses.fields(cls)})
    return out


def _b64_json(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode("utf-8")).decode("utf-8")


def _cli_pair(key: str, value: Any) -> list[str]:
    """GPT-NeoX's ``convert_key_value_to_command_line_arg``: a true bool is a bare flag, False/None nothing."""
    if isinstance(value, bool):
        return [f"--{key}"] if value else []
    return [] if value is None else [f"--{key}", str(value)]


class TokenizerBuilder:
    """GPT-NeoX's ``NeoXArgs.build_tokenizer()`` runs the tokenizer layer, which sits above this one
    (docs/architecture.md) and so cannot be imported here: ``megatron.tokenizer`` hands its
    ``build_neox_args_tokenizer`` down with :meth:`provide` when it is imported (as every run, ``megatron.training``'s
    GPT-NeoX names and the generation API import it)."""

    def __init__(self) -> None:
        self._build: Callable[[Any], Any] | None = None

    def provide(self, build: Callable[[Any], Any]) -> None:
        """Set the builder (the tokenizer package's import does)."""
        self._build = build

    def __call__(self, args: Any) -> Any:
        if self._build is None:
            raise RuntimeError(
                "NeoXArgs.build_tokenizer(): the tokenizer package is not loaded; import megatron.tokenizer first "
                "(or call megatron.tokenizer.build_neox_args_tokenizer(args))"
            )
        return self._build(args)


TOKENIZER_BUILDER = TokenizerBuilder()


class GptNeoXArgsApi:
    """Mixed into ``NeoXArgs``; relies on its ``to_dict``, ``deepspeed_config``, ``sections`` and key attributes."""

    # GPT-NeoX's NeoXArgs is a dataclass: scripts list its keys with ``NeoXArgs.__dataclass_fields__``.
    __dataclass_fields__: dict[str, dataclasses.Field] = _all_fields()

    # Provided by NeoXArgs (declared for the type checker).
    to_dict: Callable[[], dict[str, Any]]

    @classmethod
    def validate_keys(cls) -> bool:
        """GPT-NeoX's check that no key is defined by two sections (logged and False when one is)."""
        seen: dict[str, str] = {}
        for section in SECTIONS.values():
            for key in (f.name for f in dataclasses.fields(section)):
                if key in seen:
                    logger.error("(%s) duplicate key %s in %s and %s", cls.__name__, key, section.__name__, seen[key])
                    return False
                seen[key] = section.__name__
        return True

    def _section_values(self, names: tuple[str, ...] | None = None, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        out: dict[str, Any] = {}
        sections: dict[str, Any] = getattr(self, "sections")  # noqa: B009 - NeoXArgs' property
        for name, section in sections.items():
            if (names is None or name in names) and name not in exclude:
                out.update(dataclasses.asdict(section))
        return out

    @property
    def megatron_config(self) -> dict[str, Any]:
        """Every key outside the two DeepSpeed sections, with its value (GPT-NeoX's ``megatron_config``)."""
        return self._section_values(exclude=_DEEPSPEED_SECTIONS)

    @property
    def all_config(self) -> dict[str, Any]:
        """Every key with its value (GPT-NeoX's ``all_config``; the same as ``to_dict()``)."""
        return self.to_dict()

    @property
    def deepspeed_runner(self) -> dict[str, Any]:
        """The DeepSpeed runner keys (hostfile, include, num_gpus, ...) with their values."""
        return self._section_values(names=("deepspeed_runner",))

    def get_deepspeed_main_args(self) -> list[str]:
        """The command line deepy hands to DeepSpeed's runner, as GPT-NeoX builds it: the runner flags that differ
        from their defaults, the user script, ``--deepspeed_config <base64 JSON>`` and ``--megatron_config <base64
        JSON>``. ``NeoXArgs.consume_neox_args(input_args=...)`` reads the result back into an equal config.

        The megatron config carries every resolved key (GPT-NeoX sends only non-defaults; the full set makes the
        worker's config independent of defaults that could differ between versions)."""
        runner = self.deepspeed_runner
        args: list[str] = []
        if runner["autotuning_run"] is not None:
            args += _cli_pair("autotuning", runner["autotuning_run"])
        defaults = dataclasses.asdict(DeepspeedRunnerArgs())
        slurm_or_mpi = bool(getattr(self, "deepspeed_slurm", False) or getattr(self, "deepspeed_mpi", False))
        for key, default in defaults.items():
            if key in ("autotuning_run", "comment", "account"):
                continue
            value = True if key == "force_multi" and slurm_or_mpi else runner[key]
            if value != default:
                args += _cli_pair(key, value)
        if getattr(self, "deepspeed_slurm", False):
            args += _cli_pair("comment", runner["comment"]) + _cli_pair("account", runner["account"])
        if "DLTS_HOSTFILE" in os.environ:
            args += _cli_pair("hostfile", os.environ["DLTS_HOSTFILE"])
        addr = master_addr(os.environ)
        if addr is not None:
            args += _cli_pair("master_addr", addr)
        if ("--include" in args or "--exclude" in args) and "--num_gpus" in args:
            logger.warning("both include/exclude and num_gpus are set: include/exclude wins over num_gpus")
            i = args.index("--num_gpus")
            del args[i : i + 2]
        user_script = getattr(self, "user_script", None)
        if not user_script:
            raise ConfigError("get_deepspeed_main_args: user_script is not set (the script deepy.py launches)")
        if launched_world_size() == getattr(self, "global_num_gpus", 1):
            # GPT-NeoX sets this process's rank values here; deepy's side of a multi-rank launch has none to set
            getattr(self, "configure_distributed_args")()  # noqa: B009 - NeoXArgs' method
        return [
            *args,
            str(user_script),
            "--deepspeed_config",
            _b64_json(getattr(self, "deepspeed_config")),  # noqa: B009 - NeoXArgs' property
            "--megatron_config",
            _b64_json(self.to_dict()),
        ]

    def build_tokenizer(self) -> Any:
        """Build the configured tokenizer, attach it as ``self.tokenizer`` and set ``padded_vocab_size``."""
        return TOKENIZER_BUILDER(self)
