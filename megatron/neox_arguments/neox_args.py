"""``NeoXArgs``: the resolved configuration, a facade over the typed section dataclasses with flat GPT-NeoX keys."""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import json
import logging
import os
import re
import sys
from typing import TYPE_CHECKING, Any, TypeVar

from megatron.cluster.worker_env import (
    describe_ranks,
    discover_rank_env,
    launched_local_rank,
    launched_rank,
    launched_world_size,
)
from megatron.neox_arguments.autotuning import autotuning_overrides, with_experiment
from megatron.neox_arguments.deepy_cli import parse_deepy_args
from megatron.neox_arguments.derive import ONEBITADAM_SCHEDULE_NOTE, PIPE_FP16_ZERO_NOTE, LaunchEnv, derive
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.gpt_neox_api import (  # noqa: F401 - GPT-NeoX's section names live in this module
    GptNeoXArgsApi,
    NeoXArgsDeepspeedConfig,
    NeoXArgsDeepspeedRunner,
    NeoXArgsLogging,
    NeoXArgsLRScheduler,
    NeoXArgsModel,
    NeoXArgsMoE,
    NeoXArgsOptimizer,
    NeoXArgsOther,
    NeoXArgsParallelism,
    NeoXArgsTextgen,
    NeoXArgsTokenizer,
    NeoXArgsTraining,
)
from megatron.neox_arguments.keys import FIELDS, HINTS, KEY_SECTION, KNOWN_KEYS
from megatron.neox_arguments.loader import (
    MergedConfig,
    apply_overrides,
    merge_config_files,
    parse_json_text,
    unknown_key_message,
)
from megatron.neox_arguments.namespace import RUNTIME_ATTRS, default_values
from megatron.neox_arguments.number_checks import huge_int_problems, short_repr
from megatron.neox_arguments.precision import dtype_of_precision
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
from megatron.neox_arguments.types import coerce_value, describe
from megatron.neox_arguments.unsupported import BF16_LOSS_SCALING, ignored_warnings, unsupported_problems
from megatron.neox_arguments.validate import validate
from megatron.neox_arguments.value_checks import value_problems
from megatron.neox_arguments.zero_offload import without_redundant_flags

logger = logging.getLogger(__name__)

_Section = TypeVar("_Section")
_SECTION_NAMES = [cls.__name__ for cls in SECTIONS.values()]


# Objects attached while running; never serialised.
# DeepSpeed-section keys that are NeoX bookkeeping, not DeepSpeed config.
# curriculum_learning: the step drives DeepSpeed's CurriculumScheduler itself (training/curriculum.py)
_NOT_DS_CONFIG = {"deepspeed", "deepspeed_extra_args", "curriculum_learning", "curriculum_seqlen", "load_universal"}
_DEEPERSPEED_ONLY = {"fp16", "bf16", "type"}
# Keys DeepSpeed 0.19 rejects outright; they are refused as unsupported when set, so only defaults get here.
_REMOVED_FROM_DEEPSPEED = {"sparse_gradients", "amp", "compression_training", "elasticity", "sparse_attention"}


def _unset(key: str, value: Any) -> bool:
    """``null`` for a key that is required or derived (schema default ``None``, or ``derived``) means "not set".

    Such a key's annotation is its resolved type (``train_batch_size: int``): ``derive()`` or the required-keys rule
    guarantee a value in every ``NeoXArgs``, so the type has no ``None`` although the input may leave it unset.
    """
    return value is None and (FIELDS[key].default is None or bool(FIELDS[key].metadata.get("derived")))


def _type_problems(values: dict[str, Any], origins: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    checked, problems = {}, []
    for key, value in values.items():
        ok, coerced = coerce_value(value, HINTS[key])
        if ok:
            checked[key] = coerced
        elif _unset(key, value):
            continue  # keeps the schema default; derive() or validate() take it from there
        else:
            where = origins.get(key, "the configuration")
            problems.append(f"{key}={short_repr(value)} in {where}: expected {describe(HINTS[key])}")
    return checked, problems


_WORD = re.compile(r"[a-z][a-z0-9_]*")


def _with_sources(problem: str, origins: dict[str, str]) -> str:
    """Append which file set each key a derive() message mentions: ``... (train_batch_size: a.yml)``."""
    keys = [w for w in dict.fromkeys(_WORD.findall(problem)) if w in origins]
    if not keys:
        return problem
    return f"{problem} ({'; '.join(f'{k}: {origins[k]}' for k in keys)})"


if TYPE_CHECKING:

    class _SchemaKeys(
        ParallelismArgs,
        ModelArgs,
        MoEArgs,
        OptimizerArgs,
        LRSchedulerArgs,
        TokenizerArgs,
        TrainingArgs,
        LoggingArgs,
        TextgenArgs,
        DeepspeedConfigArgs,
        DeepspeedRunnerArgs,
        OtherArgs,
    ):
        """For the type checker only: every key with its schema type, so mypy checks each ``args.key`` read.

        At run time ``NeoXArgs`` serves the keys from its section objects (``__getattr__``); this base does not exist
        then. tests/unit/test_typed_args.py checks mypy sees every key and reports a misuse.
        """

        # Objects attached while running (RUNTIME_ATTRS).
        tokenizer: Any
        tensorboard_writer: Any
        adlr_autoresume_object: Any

else:

    class _SchemaKeys:
        """Empty at run time: ``NeoXArgs.__getattr__`` serves the keys."""


class NeoXArgs(_SchemaKeys, GptNeoXArgsApi):
    """The resolved configuration. Read any GPT-NeoX key as an attribute: ``args.hidden_size``.

    Build it with ``from_ymls`` (config files), ``from_dict`` or, on a launched rank, ``consume_neox_args``.
    Construction type-checks every value, runs ``derive()``, the validation rules and the unsupported-feature
    table, and raises one ``ConfigError`` listing every problem. GPT-NeoX's scripting names (``get_deepspeed_main_args``,
    ``megatron_config``, ``build_tokenizer``, ...) come from ``GptNeoXArgsApi``.
    """

    _sections: dict[str, Any]
    _runtime: dict[str, Any]
    origins: dict[str, str]
    explicit_keys: set[str]

    def __init__(
        self,
        values: dict[str, Any] | None = None,
        *,
        origins: dict[str, str] | None = None,
        env: LaunchEnv | None = None,
    ) -> None:
        values = dict(values or {})
        origins = dict(origins or {})
        unknown = [k for k in values if k not in KNOWN_KEYS]
        if unknown:
            raise ConfigError(
                [unknown_key_message(k, origins.get(k, "the configuration"), KNOWN_KEYS) for k in unknown]
            )
        problems = huge_int_problems(values, origins)  # first: nothing below can even print such a number
        if problems:
            raise ConfigError(problems)
        checked, problems = _type_problems(values, origins)
        problems += value_problems(checked, origins)  # ranges and syntax of the given values, before deriving
        if problems:
            raise ConfigError(problems)
        resolved = default_values()
        resolved.update(checked)
        env = env or LaunchEnv.capture(resolved["hostfile"])
        updates, problems = derive(resolved, set(checked), env)
        problems = [_with_sources(p, origins) for p in problems]
        resolved.update(updates)
        # A feature we do not implement is the root cause of anything else that looks wrong: report it alone.
        defaults = default_values()
        problems = unsupported_problems(resolved, defaults, origins, env.on_cpu) or problems + validate(
            resolved, origins, defaults
        )
        if problems:
            raise ConfigError(problems)
        if resolved["zero_stage"] != ((checked.get("zero_optimization") or {}).get("stage") or 0):
            logger.warning(PIPE_FP16_ZERO_NOTE)
        if resolved["optimizer_type"] == "onebitadam":
            logger.warning(ONEBITADAM_SCHEDULE_NOTE)
        for note in ignored_warnings(resolved, defaults, origins):
            logger.warning(note)
        # fp16 on a CPU: the ranks decide at start (training/cpu_precision.py: runs where the CPU has native fp16)
        object.__setattr__(self, "_sections", {name: cls() for name, cls in SECTIONS.items()})
        object.__setattr__(self, "_runtime", dict.fromkeys(RUNTIME_ATTRS))
        object.__setattr__(self, "origins", origins)
        object.__setattr__(self, "explicit_keys", set(checked))
        for key, value in resolved.items():
            setattr(self._sections[KEY_SECTION[key]], key, value)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_ymls(cls, paths: list[str], overwrite_values: dict | None = None) -> NeoXArgs:
        """Load and merge GPT-NeoX YAML/JSON files in order, apply ``overwrite_values``, resolve and validate."""
        merged = merge_config_files([str(p) for p in paths], KNOWN_KEYS)
        if overwrite_values:
            apply_overrides(merged, overwrite_values, KNOWN_KEYS, "the overrides")
        return cls._from_merged(merged)

    @classmethod
    def _from_merged(cls, merged: MergedConfig) -> NeoXArgs:
        values = dict(merged.values)
        if merged.config_files and "config_files" not in values:
            values["config_files"] = merged.config_files
        if "git_hash" not in values:
            values["git_hash"] = _git_hash()
        return cls(values, origins=merged.origins)

    @classmethod
    def from_dict(cls, args_dict: dict) -> NeoXArgs:
        """Build from a flat dict of GPT-NeoX keys (``-`` or ``_`` spellings), e.g. ``to_dict()``'s output."""
        merged = MergedConfig()
        apply_overrides(merged, args_dict, KNOWN_KEYS, "the dict")
        return cls(merged.values, origins=merged.origins)

    @classmethod
    def consume_deepy_args(cls, input_args: list[str] | None = None) -> NeoXArgs:
        """deepy.py's side: ``SCRIPT [-d DIR] a.yml [b.yml ...] [--key value ...]`` (``sys.argv[1:]`` by default)
        merged and validated, as GPT-NeoX's ``NeoXArgs.consume_deepy_args``."""
        cli = parse_deepy_args(sys.argv[1:] if input_args is None else list(input_args))
        return cls.from_ymls(cli.config_files, cli.overrides)

    @classmethod
    def consume_neox_args(cls, overwrite_values: dict | None = None, input_args: list[str] | None = None) -> NeoXArgs:
        """Worker side: read ``--neox_config PATH`` (JSON), ``--megatron_config`` (a JSON file, as current GPT-NeoX
        passes it, or base64 JSON, as older GPT-NeoX did) or config files (``torchrun ... train.py a.yml b.yml``,
        ``mpirun ... train.py a.yml``); other args are ignored. ``input_args`` defaults to ``sys.argv[1:]``.
        The launcher's rank variables (torchrun, DeepSpeed, srun, mpirun: ``megatron.cluster.worker_env``) are read
        before the config is resolved, then ``configure_distributed_args()``.
        """
        parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
        parser.add_argument("--neox_config", default=None)
        parser.add_argument("--megatron_config", default=None)
        parser.add_argument("--deepspeed_config", default=None)
        parser.add_argument("--local_rank", type=int, default=None)
        known, rest = parser.parse_known_args(sys.argv[1:] if input_args is None else list(input_args))
        files = [a for a in rest if a.endswith((".yml", ".yaml", ".json"))]
        merged: MergedConfig | None = None
        path = known.neox_config or (
            known.megatron_config if known.megatron_config and os.path.isfile(known.megatron_config) else None
        )
        if path:
            flag = "--neox_config" if known.neox_config else "--megatron_config"
            if os.path.isdir(path):
                raise ConfigError(f"{flag} {path} is a directory, not a config file")
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"{flag} {path}: cannot read the resolved config: {e}") from None
            d = parse_json_text(text, f"{flag} {path}")
        elif known.megatron_config:
            try:
                text = base64.urlsafe_b64decode(known.megatron_config).decode("utf-8")
            except ValueError as e:
                raise ConfigError(f"--megatron_config: neither a JSON file nor base64-encoded JSON: {e}") from None
            d = parse_json_text(text, "--megatron_config")
        elif files:
            merged = merge_config_files(files, KNOWN_KEYS)
            d = merged.values
        else:
            raise ConfigError(
                "no config given: expected --neox_config PATH (as passed by deepy.py), --megatron_config or "
                "config files (train.py a.yml b.yml)"
            )
        if not isinstance(d, dict):
            raise ConfigError(f"the resolved config must be a mapping of keys to values, got {type(d).__name__}")
        if known.deepspeed_config is not None:  # an experiment of DeepSpeed's autotuner: its batch and ZeRO settings
            d = with_experiment(d, autotuning_overrides(known.deepspeed_config))
        if overwrite_values:
            d = {**d, **overwrite_values}
        # srun/mpirun start the ranks without RANK/WORLD_SIZE: read them first, the world size resolves the config.
        port = d.get("master_port")  # checked with the config below; only a valid one may fill MASTER_PORT
        port = port if isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535 else None
        source = discover_rank_env(
            os.environ, prefer_slurm=bool(d.get("deepspeed_slurm")), master_port=port, fill_defaults=False
        )
        if merged is not None:
            if overwrite_values:
                apply_overrides(merged, overwrite_values, KNOWN_KEYS, "the overrides")
            args = cls._from_merged(merged)
        else:
            args = cls.from_dict(d)
        args.configure_distributed_args(known.local_rank)
        if args.rank == 0:
            logger.info(describe_ranks(os.environ, source))
            logger.info("resolved configuration:\n%s", args.format_config())
        return args

    def configure_distributed_args(self, local_rank: int | None = None) -> None:
        """Set ``rank``, ``local_rank`` and ``world_size`` from the launcher's environment (torchrun/DeepSpeed
        variables, else SLURM's or MPI's) and check the world size is the one the config was resolved for."""
        discover_rank_env(
            os.environ, prefer_slurm=self.deepspeed_slurm, master_port=self.master_port, fill_defaults=False
        )
        env = os.environ
        world = launched_world_size(env)
        if world != self.global_num_gpus:
            raise ConfigError(
                f"this rank was launched with WORLD_SIZE={world} but the config was resolved for "
                f"global_num_gpus={self.global_num_gpus}; relaunch with deepy.py"
            )
        self.update_value("rank", launched_rank(env))
        given = local_rank if local_rank is not None else 0
        self.update_value("local_rank", launched_local_rank(env) if "LOCAL_RANK" in env else given)
        self.update_value("world_size", world)

    # ------------------------------------------------------------------ access

    if not TYPE_CHECKING:  # hidden from mypy: an unknown name is an error there, not Any

        def __getattr__(self, name: str) -> Any:
            section = KEY_SECTION.get(name)
            if section is not None:
                return getattr(self._sections[section], name)
            if name in RUNTIME_ATTRS:
                return self._runtime[name]
            raise AttributeError(f"NeoXArgs has no key {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        self.update_value(name, value)

    def update_value(self, key: str, value: Any) -> None:
        """Set one key after construction (runtime values: padded_vocab_size, iteration, rank, ...)."""
        if key in RUNTIME_ATTRS:
            self._runtime[key] = value
            return
        if key not in KNOWN_KEYS:
            raise ValueError(unknown_key_message(key, "update_value", KNOWN_KEYS))
        ok, coerced = coerce_value(value, HINTS[key])
        if not ok:
            raise ValueError(f"update_value: {key}={value!r}: expected {describe(HINTS[key])}")
        setattr(self._sections[KEY_SECTION[key]], key, coerced)

    def update_values(self, d: dict[str, Any]) -> None:
        """``update_value`` for each item."""
        for key, value in d.items():
            self.update_value(key, value)

    def derived(self, **values: Any) -> NeoXArgs:
        """A copy with ``values`` set (type-checked as by ``update_value``); this object is not changed.

        For the values known only after validation (the tokenizer, the padded vocabulary size, ``train_iters`` from
        ``train_epochs``): ``pretrain`` derives them into its own copy, so the caller's arguments stay as validated.
        """
        clone = object.__new__(type(self))
        object.__setattr__(clone, "_sections", {name: copy.copy(s) for name, s in self._sections.items()})
        object.__setattr__(clone, "_runtime", dict(self._runtime))
        object.__setattr__(clone, "origins", dict(self.origins))
        object.__setattr__(clone, "explicit_keys", set(self.explicit_keys))
        clone.update_values(values)
        return clone

    @property
    def sections(self) -> dict[str, Any]:
        """Section name -> its dataclass instance (parallelism, model, moe, optimizer, ...)."""
        return dict(self._sections)

    def section(self, cls: type[_Section]) -> _Section:
        """The live, typed section object of the dataclass ``cls``: ``args.section(ModelArgs).hidden_size``.

        Reads see ``update_value``'s changes; write through ``update_value`` (it type-checks) rather than to it.
        """
        for section in self._sections.values():
            if type(section) is cls:
                return section
        raise TypeError(f"{cls.__name__} is not a config section; expected one of {', '.join(_SECTION_NAMES)}")

    @staticmethod
    def defaults() -> dict[str, Any]:
        """Every key with its default."""
        return default_values()

    def to_dict(self) -> dict[str, Any]:
        """Every key with its resolved value (JSON-serialisable; runtime objects such as the tokenizer excluded)."""
        out: dict[str, Any] = {}
        for section in self._sections.values():
            out.update(dataclasses.asdict(section))
        return out

    def save_config(self, path: str) -> None:
        """Write ``to_dict()`` as JSON to ``path``."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed config dict: every DeepSpeed key with a value (its resolved value, whether or not it equals
        our default: DeepSpeed's own defaults differ, e.g. ``steps_per_print`` None and ``gradient_clipping`` 0),
        then ``deepspeed_extra_args``. Keys left ``None`` are omitted so DeepSpeed applies its own default."""
        section = self._sections["deepspeed_config"]
        ds: dict[str, Any] = {}
        for f in dataclasses.fields(DeepspeedConfigArgs):
            value = getattr(section, f.name)
            if f.name == "autotuning" and self.autotuning_run is None:
                continue  # DeepSpeed's autotuner's block: only under deepy.py --autotuning (else warned as ignored)
            if f.name not in _NOT_DS_CONFIG and f.name not in _REMOVED_FROM_DEEPSPEED and value is not None:
                ds[f.name] = copy.deepcopy(value)
        for block in ("fp16", "bf16"):
            # GPT-NeoX configs write `"fp16": true` / `"type"` inside these blocks, which only DeeperSpeed accepts.
            if isinstance(ds.get(block), dict):
                drop = _DEEPERSPEED_ONLY | (set(BF16_LOSS_SCALING) if block == "bf16" else set())
                ds[block] = {k: v for k, v in ds[block].items() if k not in drop}
        if isinstance(ds.get("zero_optimization"), dict):
            ds["zero_optimization"] = without_redundant_flags(ds["zero_optimization"])
        if section.load_universal:  # DeepSpeed's engine reads it from its config (checkpoint.load_universal)
            ds["checkpoint"] = {**(ds.get("checkpoint") or {}), "load_universal": True}
        extra = self.deepspeed_extra_args or {}
        clash = sorted(k for k in extra if k in ds and k in self.explicit_keys)
        if clash:
            raise ConfigError(f"deepspeed_extra_args sets {', '.join(clash)}, which is also set at top level; keep one")
        ds.update(extra)
        return ds

    @property
    def params_dtype(self) -> Any:
        """torch dtype of the parameters: float16, bfloat16 or float32 by ``precision``."""
        return dtype_of_precision(self.precision or "fp32")

    def format_config(self) -> str:
        """The full resolved config, one ``key ..... value`` line per key, by section (user-set keys marked)."""
        lines = []
        for name, section in self._sections.items():
            lines.append(f"[{name}]")
            for f in dataclasses.fields(section):
                if f.name == "config_files":
                    continue
                mark = "*" if f.name in self.explicit_keys else " "
                lines.append(f" {mark} {f.name} {'.' * max(2, 44 - len(f.name))} {getattr(section, f.name)!r}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"NeoXArgs({len(self.explicit_keys)} keys set)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NeoXArgs) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]


def _git_hash() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "describe", "--always"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
