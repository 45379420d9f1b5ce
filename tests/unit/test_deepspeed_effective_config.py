"""The DeepSpeed settings a run gets under GPT-NeoX and under neox-forge, compared setting by setting.

GPT-NeoX hands DeepSpeed only the keys whose value differs from GPT-NeoX's own default (its ``deepspeed_config``
property: ``get_parent_class_value_dict_extra_ds(..., only_non_defaults=True)``); a key it drops takes the default
of the DeepSpeed it runs on, EleutherAI's DeeperSpeed fork (the defaults used are stored, with their commit and
file, in tests/fixtures/gpt-neox/deeperspeed_defaults.json). We hand the installed DeepSpeed every key resolved.
Both configs are parsed by the installed ``DeepSpeedConfig``; every setting that differs must have its row in
docs/gpt-neox-differences.md (``ROWS``), and every row named here must still differ somewhere.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from deepspeed.runtime.config import DeepSpeedConfig

from megatron.parallel_config import ParallelConfig
from megatron.training.optimizers import OptimizerConfig, deepspeed_config_for
from tests.unit.test_training_gpt_neox_golden import DS, _ours

ROOT = Path(__file__).resolve().parents[2]
DEEPERSPEED = json.loads((ROOT / "tests/fixtures/gpt-neox/deeperspeed_defaults.json").read_text())
DOC = ROOT / "docs/gpt-neox-differences.md"

# A setting (the start of its path in the parsed DeepSpeedConfig) -> the start of its row in the differences page.
ROWS: dict[str, str] = {
    "gradient_clipping": "| Gradient clipping in a default run",
    "float16_config.loss_scale": "| Top-level `loss_scale`",
    "zero_config.stage": "| fp16 with `pipe_parallel_size` ≥ 1 and ZeRO stage 0",
    "zero_optimization_stage": "| fp16 with `pipe_parallel_size` ≥ 1 and ZeRO stage 0",
    "zero_enabled": "| fp16 with `pipe_parallel_size` ≥ 1 and ZeRO stage 0",
    "scheduler_": "| `optimizer.type: onebitadam`",
    "zero_config.offload_optimizer.pin_memory": "| ZeRO offload `pin_memory`",
}


def gpt_neox_effective(passed: dict[str, Any]) -> dict[str, Any]:
    """What DeeperSpeed runs with when GPT-NeoX passes ``passed``, as an explicit config for the installed parser."""
    cfg = copy.deepcopy(passed)
    if isinstance(cfg.get("fp16"), dict):
        cfg["fp16"].pop("type", None)  # GPT-NeoX's own marker; DeeperSpeed reads only the fp16 keys it knows
    optimizer_type = str((cfg.get("optimizer") or {}).get("type", "")).lower()
    if optimizer_type != "onebitadam":
        # GPT-NeoX builds the optimizer and LR scheduler itself and hands both to deepspeed.initialize, which then
        # ignores these blocks; only for onebitadam does it hand neither (training.py get_optimizer and
        # get_learning_rate_scheduler), so DeepSpeed builds both from them.
        cfg.pop("optimizer", None)
        cfg.pop("scheduler", None)
    for default in DEEPERSPEED["defaults"]:
        *parents, leaf = default["key"].split(".")
        block = cfg
        for name in parents:
            block = block.get(name) if isinstance(block, dict) else None
        if isinstance(block, dict) and leaf not in block:
            block[leaf] = default["value"]
    return cfg


def settings(ds_config: dict[str, Any]) -> dict[str, Any]:
    """Every setting the installed DeepSpeed derives from ``ds_config``, flattened to dotted paths."""
    parsed = {k: v for k, v in vars(DeepSpeedConfig(ds_config)).items() if k != "_param_dict"}
    out: dict[str, Any] = {}
    _flatten(parsed, "", out)
    return out


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        value = vars(value)
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{path}.{key}" if path else str(key), out)
    else:
        out[path] = value


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool | None):
        return math.isclose(a, b)
    return bool(a == b)


def differing_settings(case: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Setting -> (GPT-NeoX's value, ours) wherever they differ, for one case of deepspeed_config.json."""
    args = _ours(case["config"])
    ours = settings(
        deepspeed_config_for(
            args.deepspeed_config, OptimizerConfig.from_neox_args(args, ParallelConfig.from_neox_args(args))
        )
    )
    theirs = settings(gpt_neox_effective(case["deepspeed_config"]))
    missing = "<not set>"
    return {
        k: (theirs.get(k, missing), ours.get(k, missing))
        for k in sorted(set(ours) | set(theirs))
        if not _equal(theirs.get(k, missing), ours.get(k, missing))
    }


def test_every_deepspeed_setting_that_differs_from_gpt_neox_has_a_row() -> None:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ")]
    problems, used = [], set()
    for case in DS["cases"]:
        for setting, (theirs, ours) in differing_settings(case).items():
            prefix = next((p for p in ROWS if setting.startswith(p)), None)
            if prefix is None:
                problems.append(f"{case['name']}: {setting} is {theirs!r} under GPT-NeoX, {ours!r} here: no row")
                continue
            used.add(prefix)
            if not any(line.startswith(ROWS[prefix]) for line in rows):
                problems.append(f"{case['name']}: {setting}: no row starting {ROWS[prefix]!r} in {DOC.name}")
    problems += [f"{p}: named in ROWS but differs in no case" for p in ROWS if p not in used]
    assert not problems, "\n".join(problems)


def test_a_default_run_clips_here_and_not_under_gpt_neox() -> None:
    """GPT-NeoX's default ``gradient_clipping: 1.0`` equals its own default, so it is not passed and DeeperSpeed
    clips at its default 0.0 (off); written out as 1.0 it is dropped alike. We pass 1.0, which DeepSpeed applies."""
    for name in ("defaults", "bf16_zero2"):
        case = next(c for c in DS["cases"] if c["name"] == name)
        assert "gradient_clipping" not in case["deepspeed_config"]
        assert differing_settings(case)["gradient_clipping"] == (0.0, 1.0)
    assert next(c for c in DS["cases"] if c["name"] == "bf16_zero2")["config"]["gradient_clipping"] == 1.0


def test_steps_per_print_is_the_same_under_both() -> None:
    """DeepSpeed 0.19 changed steps_per_print's default (10 -> None); we pass GPT-NeoX's 10, which is what
    DeeperSpeed's default gives GPT-NeoX, so DeepSpeed's log cadence is the same (no row)."""
    for case in DS["cases"]:
        assert "steps_per_print" not in differing_settings(case)
