"""Every config key is used, refused when set, or warned about as ignored: a key nothing reads and no table lists fails.
Statically (its name is read by code) for every key, and dynamically for every key of a scalar type: set to a
non-default value it must be refused, warned about, or change the DeepSpeed config, a module config or another key.

"Used" means the key's name occurs as an identifier (or a one-identifier string) in code that acts on it (megatron/, tools/, the entry points), not counting the
schema (sections/), the refusal and ignore tables, the docs generator and validate.py (checking a key is not using
it); DeepSpeed-section keys count as used because ``NeoXArgs.deepspeed_config`` hands them to DeepSpeed.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.neox_args import _NOT_DS_CONFIG
from megatron.neox_arguments.sections import SECTIONS, DeepspeedConfigArgs
from megatron.neox_arguments.unsupported import IGNORED_KEYS, UNSUPPORTED_KEYS
from megatron.parallel_config import ParallelConfig
from tests.unit.test_module_configs import CONFIGS
from tests.unit.test_neox_args import CPU1, TINY

ROOT = Path(__file__).resolve().parents[2]
NOT_CONSUMERS = (
    "megatron/neox_arguments/sections/",
    "megatron/neox_arguments/unsupported.py",
    "megatron/neox_arguments/gen_docs.py",
    "megatron/neox_arguments/validate.py",
)


def _names_in(source: str) -> set[str]:
    """Identifiers the code uses: names, attributes, keyword and parameter names, and string constants that are a
    single identifier (``getattr(args, "key")``). Comments and docstrings do not count."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.keyword, ast.arg)) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
    return names


def _code_words() -> set[str]:
    files = [*ROOT.glob("megatron/**/*.py"), *ROOT.glob("tools/**/*.py"), *ROOT.glob("*.py")]
    words: set[str] = set()
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(NOT_CONSUMERS):
            words |= _names_in(path.read_text(encoding="utf-8"))
    return words


def _module_config_keys() -> set[str]:
    """Keys a module config holds (it inherits them from the schema and ``from_neox_args`` reads them all)."""
    from tests.unit.test_module_configs import CONFIGS

    return {f.name for cls in CONFIGS for f in dataclasses.fields(cls)}


def test_every_key_is_used_refused_or_warned() -> None:
    words = _code_words() | _module_config_keys()
    passed_to_deepspeed = {f.name for f in dataclasses.fields(DeepspeedConfigArgs)} - _NOT_DS_CONFIG
    orphans = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = f.name
            if key in words or key in passed_to_deepspeed or key in UNSUPPORTED_KEYS or key in IGNORED_KEYS:
                continue
            orphans.append(f"{section}.{key}")
    assert not orphans, f"keys nothing reads and no table lists (use, refuse or warn): {orphans}"


def test_tables_do_not_overlap_and_name_real_keys() -> None:
    known = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    for table in (IGNORED_KEYS, UNSUPPORTED_KEYS):
        assert set(table) <= known, set(table) - known
    assert not set(IGNORED_KEYS) & set(UNSUPPORTED_KEYS)


def test_ignored_key_is_warned_with_reason_and_file(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        NeoXArgs({**TINY, "hysteresis": 4}, origins={"hysteresis": "run.yml"}, env=CPU1)
    lines = [r.getMessage() for r in caplog.records if "hysteresis" in r.getMessage()]
    assert lines == [f"hysteresis=4 is ignored: {IGNORED_KEYS['hysteresis']} (set in run.yml)"]


def test_default_values_are_not_warned(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        NeoXArgs(dict(TINY), env=CPU1)
    assert not [r for r in caplog.records if "is ignored" in r.getMessage()]


@pytest.mark.parametrize(
    ("key", "value", "feature"),
    [
        ("te_mha", True, "Transformer Engine"),
        ("adlr_autoresume", True, "ADLR auto-resume"),
    ],
)
def test_unbuilt_features_are_refused(key: str, value: object, feature: str) -> None:
    with pytest.raises(ConfigError) as e:
        NeoXArgs({**TINY, key: value}, env=CPU1)
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith(f"not supported yet: {key}=") and feature in e.value.problems[0]


def test_precompute_model_name_is_read_by_dpo_and_kto() -> None:
    """DPO/KTO read the reference log-probs ``text_gen_type: precompute`` wrote (tests/e2e/test_post_training.py);
    with ``dpo_reference_free`` there is no reference to read."""
    from megatron.post_training.config import PostTrainingConfig

    pairs = {
        "dataset_impl": "pairwise",
        "pos_train_data_paths": ["p"],
        "neg_train_data_paths": ["n"],
        "data_path": None,
    }
    for impl, extra, reads in (("dpo", {}, True), ("dpo", {"dpo_reference_free": True}, False), ("rm", {}, False)):
        args = NeoXArgs(
            {**TINY, **pairs, "pack_impl": "unpacked", "train_impl": impl, "precompute_model_name": "ref", **extra},
            env=CPU1,
        )
        assert PostTrainingConfig.from_neox_args(args).reads_precomputed_reference is reads, (impl, extra)


@pytest.mark.parametrize(
    ("key", "value"), [("scheduler", {"type": "WarmupLR", "params": {}}), ("curriculum_seqlen", 16), ("hysteresis", 4)]
)
def test_keys_that_change_nothing_are_warned(key: str, value: object, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        NeoXArgs({**TINY, key: value}, env=CPU1)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{key}=")], key


def test_static_loss_scale_reaches_the_fp16_block(caplog: pytest.LogCaptureFixture) -> None:
    """GPT-NeoX drops a top-level ``loss_scale`` (DeepSpeed then scales dynamically); we hand it to DeepSpeed."""
    ds = NeoXArgs({**TINY, "precision": "fp16", "loss_scale": 256}, env=CPU1).deepspeed_config
    assert ds["fp16"] == {"enabled": True, "loss_scale": 256}
    parsed = DeepSpeedConfig(dict(ds))  # DeepSpeed itself reads a static scale from it
    assert parsed.float16_config.enabled and parsed.float16_config.loss_scale == 256
    dynamic = DeepSpeedConfig(NeoXArgs({**TINY, "precision": "fp16"}, env=CPU1).deepspeed_config)
    assert dynamic.float16_config.loss_scale == 0
    block = {"enabled": True, "loss_scale": 256, "initial_scale_power": 12}
    both = NeoXArgs({**TINY, "fp16": block, "loss_scale": 256}, env=CPU1).deepspeed_config
    assert both["fp16"] == block
    assert NeoXArgs({**TINY, "fp16": {"enabled": True}}, env=CPU1).deepspeed_config["fp16"] == {"enabled": True}
    with pytest.raises(ConfigError, match=r"loss_scale=128.0 conflicts with fp16.loss_scale=256"):
        NeoXArgs({**TINY, "fp16": block, "loss_scale": 128}, env=CPU1)
    with caplog.at_level(logging.WARNING):
        ds = NeoXArgs({**TINY, "precision": "bfloat16", "loss_scale": 256}, env=CPU1).deepspeed_config
    assert "fp16" not in ds or not ds["fp16"].get("enabled")
    assert any("loss_scale=256.0 is ignored" in r.getMessage() for r in caplog.records)


# Keys whose effect is outside what the walk below observes (the DeepSpeed config, the module configs, the derived
# keys), with the code that reads them (the static test above checks that something does).
READ_ELSEWHERE: dict[str, str] = {
    **dict.fromkeys(("world_size", "rank", "local_rank"), "set by the launcher in each rank's environment"),
    "padded_vocab_size": "set from the tokenizer; the model reads it (test_model_gpt_neox_golden.py)",
    "char_level_ppl": "read by the training loop and in-training evaluation",
    "max_consecutive_nonfinite_steps": "read by pretrain's non-finite guard (megatron/training/nonfinite.py)",
    "loss_spike_skip_zscore": "read by pretrain's loss-spike guard (megatron/training/loss_spike.py)",
}


def _scalar_candidate(hint: Any, default: Any) -> Any:
    """A valid-looking non-default value for a key of a scalar type (bool, int, float, str, Literal); else None."""
    options = (
        [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is not Literal else []
    )
    t = options[0] if options else hint
    if typing.get_origin(t) is Literal:
        return next((c for c in typing.get_args(t) if c != default), None)
    if t is bool:
        return True if default is None else not default
    if t is int:
        return (default or 0) + 1
    if t is float:
        return default / 2 if default else 0.5
    if t is str:
        return "x"
    return None


def _observable(args: NeoXArgs) -> dict[str, str]:
    """Everything a key can change: the DeepSpeed config, every module config (or its refusal), every key's resolved
    value."""
    seen = {"deepspeed": json.dumps(args.deepspeed_config, sort_keys=True, default=str)}
    for cls in CONFIGS:
        try:
            if cls.__name__ == "BatchConfig":
                cfg = cls.from_neox_args(args, 0)
            elif cls.__name__ == "PlanInputs":  # the planner passes the padded vocabulary it resolved
                cfg = cls.from_neox_args(args, args.padded_vocab_size)
            elif cls.__name__ == "OptimizerConfig":  # receives the ZeRO stage from its owner, the parallel layout
                cfg = cls.from_neox_args(args, ParallelConfig.from_neox_args(args))
            else:
                cfg = cls.from_neox_args(args)
        except ValueError as e:  # refused when the module is built (ConfigError is a ValueError)
            seen[cls.__name__] = f"refused: {e}"
            continue
        # not what the module reads: a callable field (InferenceConfig.model_for) holds a snapshot of every key, and
        # LauncherConfig.explicit_keys names every key set
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "explicit_keys"}
        seen[cls.__name__] = repr({k: v for k, v in fields.items() if not callable(v)})
    seen.update({f"key {k}": repr(v) for k, v in args.to_dict().items()})
    return seen


def test_every_scalar_key_set_changes_something_or_is_refused_or_warned(caplog: pytest.LogCaptureFixture) -> None:
    """Walks every schema key of a scalar type, sets a non-default value and checks the config refuses it (an error
    naming the key), warns about it, or changes something observable besides the key itself; keys read only by
    entry points are listed in READ_ELSEWHERE. Lists, mappings and paths are covered by the static test above."""
    base_values = {**TINY, "train_iters": 10}

    def build(values: dict[str, Any]) -> NeoXArgs:
        args = NeoXArgs(values, env=CPU1)
        args.update_value("padded_vocab_size", 128)
        return args

    base = _observable(build(base_values))
    silent, errors = [], []
    for cls in SECTIONS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f.name
            if key in UNSUPPORTED_KEYS or key in IGNORED_KEYS or f.metadata.get("derived"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            value = _scalar_candidate(hints[key], default)
            if value is None:
                continue
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                try:
                    args = build({**base_values, key: value})
                except ConfigError as e:
                    if not any(key in p for p in e.problems):
                        errors.append(f"{key}={value!r}: {e.problems[0]}")
                    continue
            if any(key in r.getMessage() for r in caplog.records):
                continue
            changed = [n for n, v in _observable(args).items() if n != f"key {key}" and v != base[n]]
            if not changed:
                silent.append(key)
    assert not errors, f"errors that do not name the key set: {errors}"
    assert sorted(silent) == sorted(READ_ELSEWHERE), (
        f"set to a non-default value, these keys change nothing observable, and are not refused, warned about or "
        f"listed in READ_ELSEWHERE: {sorted(set(silent) - set(READ_ELSEWHERE))}; stale entries: "
        f"{sorted(set(READ_ELSEWHERE) - set(silent))}"
    )


def test_clip_grad_only_mirrors_gradient_clipping() -> None:
    """``clip_grad`` is derived from ``gradient_clipping`` (as GPT-NeoX sets it) and read by nothing: DeepSpeed clips
    at ``gradient_clipping``. A set ``clip_grad`` that agrees is accepted; one that differs is refused, naming both
    keys, instead of being silently dropped."""
    args = NeoXArgs({**TINY, "gradient_clipping": 0.5}, env=CPU1)
    assert args.clip_grad == 0.5 and args.deepspeed_config["gradient_clipping"] == 0.5
    same = NeoXArgs({**TINY, "gradient_clipping": 0.5, "clip_grad": 0.5}, env=CPU1)
    assert same.deepspeed_config["gradient_clipping"] == 0.5
    with pytest.raises(ConfigError) as e:
        NeoXArgs({**TINY, "clip_grad": 0.25}, env=CPU1)
    (problem,) = [p for p in e.value.problems if "clip_grad" in p]
    assert (
        problem.startswith("clip_grad=0.25 differs from gradient_clipping=1.0") and "gradient_clipping: 0.25" in problem
    )
