"""Optimizer construction, param groups and the update rules of the optimizers we implement."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from megatron.training.optim_algorithms import MADGRAD, SM3, Lion
from megatron.training.optimizers import (
    OptimizerConfig,
    build_optimizer,
    deepspeed_config_for,
    weight_decay_param_groups,
)


class RMSNorm(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.rms = RMSNorm(8)
        self.fc = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.flagged = torch.nn.Parameter(torch.zeros(3))
        self.flagged._no_weight_decay = True


def _ids(params: list[torch.nn.Parameter]) -> set[int]:
    return {id(p) for p in params}


def test_param_groups_follow_gpt_neox() -> None:
    m = Tiny()
    decay, no_decay = weight_decay_param_groups(m, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert _ids(decay["params"]) == {id(m.emb.weight), id(m.fc.weight)}
    assert _ids(no_decay["params"]) == {
        id(m.norm.weight),
        id(m.norm.bias),
        id(m.rms.scale),
        id(m.fc.bias),
        id(m.flagged),
    }
    (single,) = weight_decay_param_groups(m, 0.0)
    assert single["weight_decay"] == 0.0 and len(single["params"]) == 7


def _cfg(kind: str, **params) -> OptimizerConfig:
    return OptimizerConfig(optimizer={"type": kind, "params": {"lr": 0.01, **params}}, lr=0.01, weight_decay=0.1)


def test_adam_is_adamw_with_groups() -> None:
    opt, groups = build_optimizer(Tiny(), _cfg("Adam", betas=[0.9, 0.95], eps=1e-8))
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.param_groups[0]["lr"] == 0.01
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert len(groups) == 2


@pytest.mark.parametrize(
    ("kind", "cls"), [("sgd", torch.optim.SGD), ("lion", Lion), ("sm3", SM3), ("madgrad_wd", MADGRAD)]
)
def test_types_map_to_classes(kind: str, cls: type) -> None:
    opt, _ = build_optimizer(Tiny(), _cfg(kind))
    assert type(opt) is cls


def test_bad_optimizer_configs_raise() -> None:
    with pytest.raises(ValueError, match="not one of"):
        build_optimizer(Tiny(), _cfg("adagrad2"))
    with pytest.raises(ValueError, match="top level"):
        build_optimizer(Tiny(), _cfg("adam", weight_decay=0.1))
    untested = OptimizerConfig(optimizer={"type": "sm3", "params": {}}, layout_zero_stage=2)
    with pytest.raises(ValueError, match="zero_allow_untested_optimizer"):
        build_optimizer(Tiny(), untested)
    untested.zero_allow_untested_optimizer = True
    assert type(build_optimizer(Tiny(), untested)[0]) is SM3
    with pytest.raises(ValueError, match="onebitadam"):
        build_optimizer(Tiny(), _cfg("OneBitAdam"))


def test_zero_offload_takes_deepspeeds_cpu_adam_or_an_explicit_override() -> None:
    """DeepSpeed refuses a client optimizer under ZeRO-Offload with a traceback at engine start (unless
    zero_force_ds_cpu_optimizer is false): the builder refuses it first, naming the keys to change."""
    offload = {"optimizer": {"type": "Adam", "params": {}}, "layout_zero_stage": 2, "offload_device": "cpu"}
    with pytest.raises(ValueError, match=r"set optimizer.type to cpu_adam \(not 'Adam'\)"):
        build_optimizer(Tiny(), OptimizerConfig(**offload))
    assert (
        type(build_optimizer(Tiny(), OptimizerConfig(**offload, force_ds_cpu_optimizer=False))[0]) is torch.optim.AdamW
    )
    assert (
        type(build_optimizer(Tiny(), OptimizerConfig(**{**offload, "offload_device": "none"}))[0]) is torch.optim.AdamW
    )
    with pytest.raises(ValueError, match="cpu_adam"):  # DeepSpeed's check does not look at the stage
        build_optimizer(Tiny(), OptimizerConfig(**{**offload, "layout_zero_stage": 0}))


def test_deepspeed_config_drops_client_side_entries() -> None:
    ds = {"train_batch_size": 4, "optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR"}}
    out = deepspeed_config_for(ds, _cfg("adam"))
    assert out == {"train_batch_size": 4}
    cfg = _cfg("sgd")
    cfg.zero_allow_untested_optimizer = True
    assert deepspeed_config_for(ds, cfg)["zero_allow_untested_optimizer"] is True


def test_lion_update_rule() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    g1, g2 = torch.tensor([0.5, -1.0, 0.0]), torch.tensor([-2.0, 0.1, 0.3])
    p.grad = g1.clone()
    opt.step()
    expected = torch.tensor([1.0, -2.0, 3.0]) * (1 - 0.05) - 0.1 * torch.sign(0.1 * g1)
    assert torch.allclose(p.detach(), expected)
    m = 0.01 * g1
    p.grad = g2.clone()
    opt.step()
    expected = expected * (1 - 0.05) - 0.1 * torch.sign(0.9 * m + 0.1 * g2)
    assert torch.allclose(p.detach(), expected)


def test_sm3_update_rule() -> None:
    w = torch.nn.Parameter(torch.zeros(2, 3))
    opt = SM3([w], lr=1.0, eps=0.0)
    g = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    w.grad = g.clone()
    opt.step()
    assert torch.allclose(w.detach(), -torch.ones(2, 3))  # first step: g / sqrt(g²)
    st = opt.state[w]
    assert torch.equal(st["acc_0"].flatten(), torch.tensor([9.0, 36.0]))  # row max of g²
    assert torch.equal(st["acc_1"].flatten(), torch.tensor([16.0, 25.0, 36.0]))  # column max
    w.grad = torch.ones(2, 3)
    opt.step()
    nu = torch.min(st["acc_0"], st["acc_1"])  # after the update; before it was min(9/36, 16/25/36) + 1
    prev = torch.min(torch.tensor([[9.0], [36.0]]), torch.tensor([[16.0, 25.0, 36.0]])) + 1
    assert torch.allclose(w.detach(), -torch.ones(2, 3) - 1 / prev.sqrt())
    assert nu.shape == (2, 3)


def test_madgrad_first_step() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = MADGRAD([p], lr=0.1, momentum=0.9, weight_decay=0.0, eps=1e-6)
    g = torch.tensor([0.5, -0.25])
    p.grad = g.clone()
    opt.step()
    lamb = 0.1 * math.sqrt(1)
    z = torch.tensor([1.0, 2.0]) - lamb * g / ((lamb * g * g) ** (1 / 3) + 1e-6)
    expected = 0.9 * torch.tensor([1.0, 2.0]) + 0.1 * z
    assert torch.allclose(p.detach(), expected)


@pytest.mark.parametrize("cls", [Lion, SM3, MADGRAD])
def test_shared_step_runs_the_closure_and_skips_parameters_without_a_gradient(cls: type) -> None:
    """The ``step()`` the three share: the closure runs with gradients on and its loss is returned; a parameter
    without a gradient is neither moved nor given state."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    idle = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = cls([{"params": [w]}, {"params": [idle]}], lr=0.1)

    def closure() -> float:
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return float(loss)

    assert opt.step(closure) == 5.0
    assert not torch.equal(w.detach(), torch.tensor([1.0, -2.0]))
    assert torch.equal(idle.detach(), torch.tensor([3.0, 4.0])) and idle not in opt.state
    assert opt.step() is None


@pytest.mark.parametrize("kind", ["adam", "sgd", "lion", "sm3", "madgrad_wd"])
def test_each_optimizer_fits_a_regression(kind: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    lr = {"adam": 0.01, "sgd": 0.05, "lion": 0.01, "sm3": 0.05, "madgrad_wd": 0.01}[kind]
    opt, _ = build_optimizer(
        model, OptimizerConfig(optimizer={"type": kind, "params": {"lr": lr}}, lr=lr, weight_decay=0.0)
    )
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def _cpu_adam_built() -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    return (Path(_get_build_directory("cpu_adam", False)) / "cpu_adam.so").is_file()


@pytest.mark.skipif(
    not _cpu_adam_built() and os.environ.get("NEOX_TEST_BUILD_OPS") != "1",
    reason="DeepSpeed's cpu_adam op is not built on this machine (its JIT build takes minutes; set NEOX_TEST_BUILD_OPS=1)",
)
@pytest.mark.parametrize("kind", ["cpu_adam", "cpu_torch_adam"])
def test_cpu_adam_follows_adamw(kind: str) -> None:
    """``cpu_adam`` / ``cpu_torch_adam`` build DeepSpeed's CPU Adam (GPT-NeoX: both do), which takes the same
    decoupled-weight-decay steps as ``adam`` (torch AdamW) on the same parameter groups."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    trajectories = {}
    for name in (kind, "adam"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        params = {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8}
        opt, _ = build_optimizer(
            model, OptimizerConfig(optimizer={"type": name, "params": params}, lr=0.01, weight_decay=0.1)
        )
        assert isinstance(opt, DeepSpeedCPUAdam) == (name != "adam")
        x, y = torch.randn(32, 4, generator=torch.Generator().manual_seed(1)), torch.ones(32, 1)
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        trajectories[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert (trajectories[name] - start).abs().max() > 1e-3  # the steps moved the weights
    assert torch.allclose(trajectories[kind], trajectories["adam"], atol=1e-6)
