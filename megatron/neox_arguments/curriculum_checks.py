"""The ``curriculum_learning`` block (GPT-NeoX's shape, read by DeepSpeed's ``CurriculumScheduler``)::

    curriculum_learning:
      enabled: true
      curriculum_type: seqlen        # the only type GPT-NeoX truncates batches for
      min_difficulty: 64             # first sequence length
      max_difficulty: 2048           # last sequence length, at most seq_length
      schedule_type: fixed_linear    # fixed_linear | fixed_root | fixed_discrete
      schedule_config: {total_curriculum_step: 20000, difficulty_step: 8}   # + root_degree for fixed_root
      # fixed_discrete: schedule_config: {difficulty: [16, 32, 64], max_step: [100, 200]}

Each problem names the sub-key and what is valid; DeepSpeed's own asserts would stop one rank with a bare message.
"""

from __future__ import annotations

from typing import Any

SCHEDULE_KEYS = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
}
BLOCK_KEYS = ("enabled", "curriculum_type", "min_difficulty", "max_difficulty", "schedule_type", "schedule_config")


def curriculum_enabled(block: Any) -> bool:
    """True when the block asks for curriculum learning (``enabled: true``)."""
    return isinstance(block, dict) and block.get("enabled") is True


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _schedule_problems(kind: str, sched: Any, seq_length: int | None) -> list[str]:
    p = "curriculum_learning.schedule_config"
    if not isinstance(sched, dict):
        return [f"{p} must be a mapping with {', '.join(SCHEDULE_KEYS[kind])} (schedule_type {kind})"]
    out = [
        f"{p}.{k} is not a setting of schedule_type {kind} (valid: {', '.join(SCHEDULE_KEYS[kind])})"
        for k in sched
        if k not in SCHEDULE_KEYS[kind]
    ]
    out += [f"{p}.{k} is required for schedule_type {kind}" for k in SCHEDULE_KEYS[kind] if k not in sched]
    if out:
        return out
    if kind == "fixed_discrete":
        diff, steps = sched["difficulty"], sched["max_step"]
        if not isinstance(diff, list) or not diff or not all(_positive_int(d) for d in diff):
            return [f"{p}.difficulty={diff!r} must be a non-empty list of sequence lengths >= 1"]
        if seq_length is not None and max(diff) > seq_length:
            out.append(f"{p}.difficulty={diff!r} must not exceed seq_length={seq_length}")
        if not isinstance(steps, list) or not all(_positive_int(s) for s in steps) or len(steps) != len(diff) - 1:
            out.append(
                f"{p}.max_step={steps!r} must be a list of {len(diff) - 1} steps >= 1 (one less than difficulty)"
            )
        elif steps != sorted(steps):
            out.append(f"{p}.max_step={steps!r} must be increasing")
        return out
    for k in SCHEDULE_KEYS[kind]:
        if not _positive_int(sched[k]):
            out.append(f"{p}.{k}={sched[k]!r} must be an integer >= 1")
    return out


def curriculum_problems(values: dict[str, Any], origins: dict[str, str] | None = None) -> list[str]:
    """Problems of the ``curriculum_learning`` block of resolved config ``values`` (none when unset or ``enabled``
    is false). GPT-NeoX cuts labels and loss mask to the curriculum length for language modelling (``train_impl:
    normal``) only. In ``deepspeed_extra_args`` the block would reach DeepSpeed, which removed its legacy curriculum and
    rejects the key: refused there with a pointer to the top-level key."""
    origins = origins or {}
    extra = values.get("deepspeed_extra_args") or {}
    if isinstance(extra, dict) and "curriculum_learning" in extra:
        where = origins.get("deepspeed_extra_args")
        at = f" (set in {where})" if where else ""
        return [f"deepspeed_extra_args.curriculum_learning{at}: set curriculum_learning at the top level instead"]
    found = block_problems(values.get("curriculum_learning"), values.get("seq_length"), values.get("train_impl"))
    where = origins.get("curriculum_learning")
    return [f"{p} (set in {where})" for p in found] if where else found


def block_problems(block: Any, seq_length: int | None, train_impl: str | None = "normal") -> list[str]:
    """Problems of a ``curriculum_learning`` block (see :func:`curriculum_problems`)."""
    if block is None:
        return []
    if not isinstance(block, dict):
        return [f"curriculum_learning={block!r} must be a mapping ({', '.join(BLOCK_KEYS)})"]
    enabled = block.get("enabled", False)
    if not isinstance(enabled, bool):
        return [f"curriculum_learning.enabled={enabled!r} must be true or false"]
    if not enabled:
        return []
    out = []
    if train_impl not in (None, "normal"):
        out.append(f"not supported yet: curriculum_learning with train_impl={train_impl!r} (only 'normal')")
    out += [
        f"curriculum_learning.{k} is not a setting (valid: {', '.join(BLOCK_KEYS)})"
        for k in block
        if k not in BLOCK_KEYS
    ]
    kind = block.get("curriculum_type", "seqlen")
    if kind != "seqlen":
        out.append(f"curriculum_learning.curriculum_type={kind!r}: only 'seqlen' is valid (as in GPT-NeoX)")
    schedule = block.get("schedule_type")
    if schedule not in SCHEDULE_KEYS:
        out.append(f"curriculum_learning.schedule_type={schedule!r} must be one of {', '.join(SCHEDULE_KEYS)}")
    lo, hi = block.get("min_difficulty"), block.get("max_difficulty")
    for name, value in (("min_difficulty", lo), ("max_difficulty", hi)):
        if not _positive_int(value):
            out.append(f"curriculum_learning.{name}={value!r} must be a sequence length >= 1 (required)")
    if isinstance(lo, int) and isinstance(hi, int) and _positive_int(lo) and _positive_int(hi):
        if lo > hi:
            out.append(f"curriculum_learning.min_difficulty={lo} must be <= max_difficulty={hi}")
        if seq_length is not None and hi > seq_length:
            out.append(f"curriculum_learning.max_difficulty={hi} must be <= seq_length={seq_length}")
    if schedule in SCHEDULE_KEYS:
        out += _schedule_problems(schedule, block.get("schedule_config"), seq_length)
    return out
