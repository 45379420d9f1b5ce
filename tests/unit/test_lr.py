"""The annealing LR schedule against GPT-NeoX's formulas, evaluated by hand at chosen iterations (GPT-NeoX's own outputs at
every step: tests/unit/test_training_gpt_neox_golden.py); plus what GPT-NeoX lacks (inverse_sqrt) and the checkpoint
round trip."""

from __future__ import annotations

import ast
import math

import pytest
import torch

from megatron.neox_arguments import neox_namespace
from megatron.training.learning_rates import AnnealingLR, LRScheduleConfig
from tests.harness import REPO_ROOT

# T = 100, warmup 0.1 → W = 10, D = 90, lr_max 1e-3, min_lr 1e-4.
LR, MIN = 1e-3, 1e-4


def _sched(style: str, **kw) -> AnnealingLR:
    cfg = LRScheduleConfig(lr=LR, min_lr=MIN, lr_decay_style=style, train_iters=100, warmup=0.1, **kw)
    return AnnealingLR(None, cfg)


def _at(s: AnnealingLR, n: int) -> float:
    s.step(n)
    return s.get_lr()


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "exponential", "inverse_sqrt"])
def test_warmup_is_linear_from_lr_over_w(style: str) -> None:
    s = _sched(style)
    assert _at(s, 0) == pytest.approx(LR / 10)  # max(1, n) / W: step 0 already has lr/W
    assert _at(s, 1) == pytest.approx(LR / 10)
    assert _at(s, 5) == pytest.approx(LR * 5 / 10)
    assert _at(s, 10) == pytest.approx(LR)


def test_linear_decay_clipped_at_min_lr() -> None:
    s = _sched("linear")
    assert _at(s, 40) == pytest.approx(LR * (90 - 30) / 90)
    assert _at(s, 91) == pytest.approx(LR * (90 - 81) / 90)  # 1e-4 exactly, not yet clipped
    assert _at(s, 95) == pytest.approx(MIN)  # 5.6e-5 → clipped
    assert _at(s, 100) == pytest.approx(MIN)


def test_cosine_decay() -> None:
    s = _sched("cosine")
    assert _at(s, 55) == pytest.approx(MIN + (LR - MIN) / 2 * (math.cos(math.pi * 45 / 90) + 1))
    assert _at(s, 55) == pytest.approx((LR + MIN) / 2)
    assert _at(s, 100) == pytest.approx(MIN)
    assert _at(s, 25) == pytest.approx(MIN + (LR - MIN) / 2 * (math.cos(math.pi * 15 / 90) + 1))


def test_exponential_decay() -> None:
    s = _sched("exponential")
    assert _at(s, 40) == pytest.approx(LR * math.exp(-0.693 * 30 / 90))
    assert _at(s, 100) == pytest.approx(LR * math.exp(-0.693))  # ≈ lr/2 at the end


def test_constant_and_inverse_sqrt() -> None:
    assert _at(_sched("constant"), 77) == pytest.approx(LR)
    assert _at(_sched("inverse_sqrt"), 40) == pytest.approx(LR * math.sqrt(10 / 40))
    assert _at(_sched("inverse_sqrt"), 4000) == pytest.approx(MIN)  # clipped


def test_decay_iters_sources() -> None:
    assert LRScheduleConfig(train_iters=100).decay_iters() == 100
    assert LRScheduleConfig(train_iters=100, lr_decay_fraction=0.33).decay_iters() == 33
    assert LRScheduleConfig(train_iters=100, lr_decay_iters=50, lr_decay_fraction=0.33).decay_iters() == 50
    s = AnnealingLR(None, LRScheduleConfig(lr=LR, train_iters=1000, lr_decay_iters=100, warmup=0.0))
    assert _at(s, 0) == pytest.approx(LR)  # no warmup: straight into decay
    assert _at(s, 50) == pytest.approx(LR / 2)
    with pytest.raises(ValueError, match="train_iters"):
        LRScheduleConfig().decay_iters()


def test_writes_lr_into_param_groups_and_from_neox_args() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [], "weight_decay": 0.0}], lr=123.0)
    args = neox_namespace(lr=LR, min_lr=None, lr_decay_style="cosine", train_iters=100, warmup=0.1)
    s = AnnealingLR(opt, LRScheduleConfig.from_neox_args(args))
    assert s.min_lr == 0.0
    assert opt.param_groups[0]["lr"] == pytest.approx(LR / 10)
    for _ in range(10):
        s.step()
    assert s.num_iters == 10
    assert all(g["lr"] == pytest.approx(LR) for g in opt.param_groups)


def test_bad_values_raise() -> None:
    with pytest.raises(ValueError, match="lr_decay_style"):
        _sched("triangle")
    with pytest.raises(ValueError, match="min_lr"):
        AnnealingLR(None, LRScheduleConfig(lr=1e-4, min_lr=1e-3, train_iters=10))


def test_state_dict_roundtrip_and_policies() -> None:
    s = _sched("cosine")
    s.step(37)
    sd = s.state_dict()
    assert set(sd) == {"start_lr", "warmup_iter", "num_iters", "decay_style", "end_iter", "min_lr"}
    fresh = _sched("cosine")
    fresh.load_state_dict(sd)
    assert fresh.num_iters == 37 and fresh.get_lr() == s.get_lr()

    changed = AnnealingLR(None, LRScheduleConfig(lr=2 * LR, min_lr=MIN, lr_decay_style="cosine", train_iters=100))
    with pytest.raises(ValueError, match="start_lr"):
        changed.load_state_dict(sd)
    take_ckpt = AnnealingLR(
        None,
        LRScheduleConfig(lr=2 * LR, lr_decay_style="linear", train_iters=100, use_checkpoint_lr_scheduler=True),
    )
    take_ckpt.load_state_dict(sd)
    assert take_ckpt.start_lr == LR and take_ckpt.decay_style == "cosine" and take_ckpt.get_lr() == s.get_lr()
    take_cfg = AnnealingLR(
        None, LRScheduleConfig(lr=2 * LR, lr_decay_style="constant", train_iters=100, override_lr_scheduler=True)
    )
    take_cfg.load_state_dict(sd)
    assert take_cfg.num_iters == 37 and take_cfg.get_lr() == pytest.approx(2 * LR)


def test_a_checkpoint_restores_the_schedule_or_resumes_it_at_its_iteration(caplog: pytest.LogCaptureFixture) -> None:
    """The step owns the schedule (DeepSpeed is given none), so loading restores it from the checkpoint's
    ``lr_scheduler`` entry; a checkpoint without one (a converter's) resumes the configured schedule at its
    iteration, with a warning."""
    from megatron.checkpoint.lr_state import restore_lr_schedule

    saved = _sched("cosine")
    saved.step(37)
    restored = _sched("cosine")
    restore_lr_schedule(restored, saved.state_dict(), 40, "ckpt/global_step40")
    assert restored.num_iters == 37 and restored.get_lr() == saved.get_lr()  # skipped steps: 37 LR steps in 40
    converted = _sched("cosine")
    with caplog.at_level("WARNING", logger="megatron.checkpoint.lr_state"):
        restore_lr_schedule(converted, None, 40, "ckpt/global_step40")
    assert converted.num_iters == 40 and converted.get_lr() == _at(_sched("cosine"), 40)
    assert any("has no LR scheduler state" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ("not a dict", "missing"),
        ({"num_iters": 3}, "missing decay_style"),
        ({**_sched("cosine").state_dict(), "num_iters": -1}, "num_iters=-1 is not a step count"),
        ({**_sched("cosine").state_dict(), "num_iters": "7"}, "num_iters='7' is not a step count"),
    ],
    ids=["str", "keys", "negative", "text"],
)
def test_a_hostile_lr_schedule_state_is_one_checkpoint_error(state: object, problem: str) -> None:
    from megatron.checkpoint.layout import CheckpointError
    from megatron.checkpoint.lr_state import restore_lr_schedule

    with pytest.raises(CheckpointError, match="lr_scheduler") as err:
        restore_lr_schedule(_sched("cosine"), state, 5, "ckpt/global_step5")
    assert problem in str(err.value) and "ckpt/global_step5" in str(err.value) and "finetune" in str(err.value)


def _calls(path: str, name: str) -> list[ast.Call]:
    tree = ast.parse((REPO_ROOT / path).read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(name)]


def test_deepspeed_gets_the_lr_schedule_only_through_gpt_neox_api() -> None:
    """docs/training.md: ``pretrain()`` hands ``deepspeed.initialize`` no LR schedule (the step moves it after an
    applied optimizer step); GPT-NeoX's ``setup_model_and_optimizer`` hands it to the engine, as GPT-NeoX does."""
    (init,) = _calls("megatron/training/pretraining.py", "deepspeed.initialize")
    given = {k.arg: ast.unparse(k.value) for k in init.keywords}
    assert given["lr_scheduler"] == "lr_scheduler if engine_steps_lr else None", given
    setups = _calls("megatron/training/pretraining.py", "setup_model_and_optimizer")
    assert setups and all("engine_steps_lr" not in {k.arg for k in c.keywords} for c in setups)
    (api,) = _calls("megatron/training/gpt_neox_api.py", "setup_model_and_optimizer")
    assert {k.arg: ast.unparse(k.value) for k in api.keywords}.get("engine_steps_lr") == "True"
    step_lr = _calls("megatron/training/step.py", "step_lr")
    assert step_lr, "the step moves the LR schedule (OptimizerStep.step_lr)"
