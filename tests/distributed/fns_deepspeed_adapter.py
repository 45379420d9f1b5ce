"""Checks of what megatron/training/deepspeed_adapter.py relies on in DeepSpeed, on real engines (one gloo rank).

Each function builds tiny DeepSpeed engines and returns plain data; tests/unit/test_deepspeed_adapter.py asserts on
it. A DeepSpeed release that changes one of the behaviours makes the matching test fail.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from megatron.training import deepspeed_adapter as ad

X = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
Y = X.sum(dim=1, keepdim=True).sin()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _engine(model: torch.nn.Module | None = None, gas: int = 1, **config: Any) -> Any:
    import deepspeed

    model = model if model is not None else _model()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
        **config,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _loss(engine: Any, micro: int = 0) -> torch.Tensor:
    x, y = X[4 * micro : 4 * micro + 4], Y[4 * micro : 4 * micro + 4]
    out = engine(x.to(next(engine.module.parameters()).dtype))
    return F.mse_loss(out.float(), y)


def _weights(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _sq(tensors: list[torch.Tensor]) -> float:
    return float(sum(t.double().pow(2).sum() for t in tensors))


def reduced_gradients_places() -> dict[str, Any]:
    """Item 1: where the reduced gradients are, for a plain, a ZeRO-1, a ZeRO-2 and the BF16 optimizer."""
    out: dict[str, Any] = {}
    for name, cfg in {
        "plain": {},
        "zero1": {"zero_optimization": {"stage": 1}},
        "zero2": {"zero_optimization": {"stage": 2}},
        "zero3": {"zero_optimization": {"stage": 3}},
        "bf16": {
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 1},
            "data_types": {"grad_accum_dtype": "fp32"},
        },
    }.items():
        engine = _engine(**cfg)
        engine.backward(_loss(engine))
        grads = ad.reduced_gradients(engine)
        out[name] = {"optimizer": type(engine.optimizer).__name__, "count": len(grads), "sq": _sq(grads)}
    return out


def fp16_loss_scale() -> dict[str, Any]:
    """Item 2: DeepSpeed's fp16 ZeRO-0 backward leaves the loss unscaled, and the scale is where the adapter reads it."""
    ad.allow_fp16_on_cpu()
    model = _model()
    reference = copy.deepcopy(model)
    F.mse_loss(reference(X[:4]), Y[:4]).backward()
    engine = _engine(model, fp16={"enabled": True, "initial_scale_power": 12})
    engine.backward(_loss(engine))
    got = [p.grad.float() for p in engine.module.parameters()]
    want = [p.grad for p in reference.parameters()]
    ratio = _sq(got) ** 0.5 / _sq(want) ** 0.5
    return {"scale": ad.manual_loss_scale(engine), "grad_ratio": ratio, "optimizer": type(engine.optimizer).__name__}


def fp32_clipping_call() -> dict[str, Any]:
    """Item 3: a plain fp32 engine clips through the instance's ``clip_fp32_gradients`` (called once per step), and
    the adapter's no-op leaves the gradients alone."""
    engine = _engine(gradient_clipping=1e-3)
    calls = []
    engine.clip_fp32_gradients = lambda: calls.append(1)  # the lookup the adapter relies on
    engine.backward(_loss(engine))
    engine.step()
    plain = _engine(gradient_clipping=1e-3)
    clipped_by_ds = _engine(gradient_clipping=1e-3)
    for e in (plain, clipped_by_ds):
        e.backward(_loss(e))
    before = _sq([p.grad for p in plain.module.parameters()])
    ad.leave_fp32_clipping_to_the_step(plain)
    plain.clip_fp32_gradients()
    clipped_by_ds.clip_fp32_gradients()
    return {
        "engine_clips": ad.engine_clips_fp32(engine),
        "zero_engine_clips": ad.engine_clips_fp32(_engine(gradient_clipping=1.0, zero_optimization={"stage": 1})),
        "calls": len(calls),
        "untouched": _sq([p.grad for p in plain.module.parameters()]) == before,
        "ds_clipped_norm": _sq([p.grad for p in clipped_by_ds.module.parameters()]) ** 0.5,
        "global_grad_norm": clipped_by_ds.get_global_grad_norm(),
    }


def _counters(engine: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(engine).items() if type(v) in (int, float, bool)}


def _changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}


WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}


def skip_bookkeeping() -> dict[str, Any]:
    """Item 4: the counters an applied boundary ``engine.step()`` moves, and those a skip moves; the skip leaves the
    weights and the LR schedule alone and the next step works."""
    applied = _engine(gas=2, scheduler=WARMUP)
    skipped = _engine(gas=2, scheduler=WARMUP)
    out: dict[str, Any] = {}
    for name, engine in (("applied", applied), ("skipped", skipped)):
        engine.backward(_loss(engine, 0))
        engine.step()  # not a boundary
        engine.backward(_loss(engine, 1))
        assert engine.is_gradient_accumulation_boundary()
        before, weights, lr = _counters(engine), _weights(engine), engine.lr_scheduler.state_dict()
        if name == "applied":
            engine.step()
        else:
            ad.skip_optimizer_step(engine, count_micro_step=True)
        out[name] = {
            "changed": _changed(before, _counters(engine)),
            "weights_moved": any(not torch.equal(a, b) for a, b in zip(weights, _weights(engine), strict=True)),
            "lr_moved": engine.lr_scheduler.state_dict() != lr,
            "grads_left": [p.grad is not None for p in engine.module.parameters()],
        }
    skipped.backward(_loss(skipped, 0))
    out["next_is_boundary"] = skipped.is_gradient_accumulation_boundary()
    skipped.step()
    skipped.backward(_loss(skipped, 1))
    out["then_boundary"] = skipped.is_gradient_accumulation_boundary()
    weights = _weights(skipped)
    skipped.step()
    out["then_applies"] = any(not torch.equal(a, b) for a, b in zip(weights, _weights(skipped), strict=True))
    return out


def _pipeline_engine(loss_fn: Any, micro: int, gas: int) -> Any:
    """A one-stage DeepSpeed pipeline engine over a tiny MLP (AdamW, no step printing)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]
    module = PipelineModule(layers=layers, num_stages=1, loss_fn=loss_fn)
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    return engine


def pipeline_optimizer_hook() -> dict[str, Any]:
    """Item 5: ``train_batch`` reaches the optimizer step through the instance's ``_take_model_step``."""
    engine = _pipeline_engine(lambda out, y: F.mse_loss(out, y), micro=4, gas=2)
    calls: list[str] = []
    decide = {"apply": True}

    def optimizer_step(apply: Any) -> None:
        calls.append("step")
        if decide["apply"]:
            apply()
        else:
            ad.skip_optimizer_step(engine, count_micro_step=False)

    ad.run_optimizer_step_through(engine, optimizer_step)
    batches = [(X[i : i + 4], Y[i : i + 4]) for i in (0, 4)]
    weights = _weights(engine)
    engine.train_batch(data_iter=iter(batches))
    applied_moved = any(not torch.equal(a, b) for a, b in zip(weights, _weights(engine), strict=True))
    decide["apply"] = False
    weights, steps = _weights(engine), engine.global_steps
    engine.train_batch(data_iter=iter(batches))
    skipped_moved = any(not torch.equal(a, b) for a, b in zip(weights, _weights(engine), strict=True))
    return {
        "calls": len(calls),
        "applied_moved": applied_moved,
        "skipped_moved": skipped_moved,
        "skipped_steps": engine.skipped_steps,
        "global_steps_advanced": engine.global_steps - steps,
    }


def pipeline_loss_at_step() -> dict[str, Any]:
    """Item 9: at the schedule's optimizer step the engine holds the sum of the iteration's micro-batch losses (all
    ``gas`` forward passes done), and ``train_batch`` returns that sum over ``gas`` (one data-parallel rank)."""
    micro_losses: list[torch.Tensor] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(out, y)
        micro_losses.append(loss.detach().clone())
        return loss

    engine = _pipeline_engine(loss_fn, micro=2, gas=3)
    at_step: list[dict[str, Any]] = []

    def optimizer_step(apply: Any) -> None:
        total = ad.pipeline_loss_sum(engine)
        at_step.append({"total": None if total is None else total.clone(), "forwards": len(micro_losses)})
        apply()

    ad.run_optimizer_step_through(engine, optimizer_step)
    out: dict[str, Any] = {"iterations": []}
    for first in (0, 2):  # two iterations: the sum starts afresh in each
        micro_losses.clear()
        batches = [(X[i : i + 2], Y[i : i + 2]) for i in (first, first + 2, first + 4)]
        returned = engine.train_batch(data_iter=iter(batches))
        want = torch.zeros_like(micro_losses[0])
        for loss in micro_losses:
            want += loss  # DeepSpeed's accumulation, in its order
        step = at_step[-1]
        out["iterations"].append(
            {
                "forwards_at_step": step["forwards"],
                "total_is_sum": step["total"] is not None and torch.equal(step["total"], want.reshape(1)),
                "returned_is_mean": float(returned) == float(step["total"] / engine.gradient_accumulation_steps()),
            }
        )
    return out


def single_rank_allreduce() -> dict[str, Any]:
    """Item 6: the boundary backward all-reduces through ``allreduce_gradients`` exactly while
    ``enable_backward_allreduce`` is True."""
    out = {}
    for skip in (False, True):
        engine = _engine()
        calls: list[int] = []

        def counted(*a: Any, _calls: list[int] = calls, _original: Any = engine.allreduce_gradients, **k: Any) -> Any:
            _calls.append(1)
            return _original(*a, **k)

        engine.allreduce_gradients = counted
        if skip:
            out["switched_off"] = ad.skip_single_rank_allreduce(engine, 1)
        engine.backward(_loss(engine))
        out["calls_skipped" if skip else "calls_default"] = len(calls)
    return out


def zero3_partitions() -> dict[str, Any]:
    """Item 7: DeepSpeed alone keeps a second fp32 copy of each fp32 ZeRO-3 partition; shared, a step gives the
    same weights as DeepSpeed's copy does."""
    out: dict[str, Any] = {}
    results = []
    for share in (False, True):
        engine = _engine(zero_optimization={"stage": 3})
        opt = engine.optimizer
        if share:
            out["shared"] = ad.share_fp32_zero3_partitions(engine)
        out["same_tensor" if share else "ds_same_tensor"] = [
            lo is hi for lo, hi in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat, strict=True)
        ]
        for _ in range(3):
            engine.backward(_loss(engine))
            engine.step()
        results.append([t.detach().clone() for t in opt.fp16_partitioned_groups_flat])
    out["equal_after_steps"] = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    return out


def fp16_on_cpu() -> dict[str, Any]:
    """Item 8: the CPU accelerator says no to fp16 (unless the CPU has native fp16: oneDNN's check) until the adapter
    answers on its (singleton) instance; the class keeps its own method."""
    from deepspeed.accelerator import get_accelerator

    from megatron.cpu_features import cpu_has_native

    cls = type(get_accelerator())
    method = cls.__dict__["is_fp16_supported"]
    before = get_accelerator().is_fp16_supported()
    ad.allow_fp16_on_cpu()
    return {
        "before": before,
        "native_fp16": cpu_has_native("fp16"),
        "after": get_accelerator().is_fp16_supported(),
        "singleton": get_accelerator() is get_accelerator(),
        "class_answer": cls.is_fp16_supported(get_accelerator()),
        "class_method_kept": cls.__dict__["is_fp16_supported"] is method,
    }


def _protocol_members(proto: type) -> set[str]:
    """The attributes and methods a ``typing.Protocol`` class declares (its own and its protocol bases')."""
    out: set[str] = set()
    for cls in proto.__mro__:
        if not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        out |= set(getattr(cls, "__annotations__", {}))
        out |= {n for n, v in vars(cls).items() if callable(v) and (not n.startswith("__") or n == "__call__")}
    return out


def _named_parameters(fn: Any) -> list[str]:
    """The parameters of ``fn`` that a caller can name, in order (``self``, ``*args`` and ``**kwargs`` left out)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds and p.name != "self"]


def _deepspeed_method(engine: Any, name: str) -> Any:
    """The function behind ``engine.<name>``, through decorators that do not set ``__wrapped__`` (DeepSpeed's
    ``instrument_w_nvtx`` wraps ``backward`` in a ``(*args, **kwargs)`` closure)."""
    fn = getattr(getattr(engine, name), "__func__", getattr(engine, name))
    while fn.__name__ != name and fn.__closure__:
        inner = [c.cell_contents for c in fn.__closure__ if inspect.isfunction(c.cell_contents)]
        if len(inner) != 1:
            break
        fn = inner[0]
    return fn


def _signature_mismatches(engine: Any, proto: type) -> list[str]:
    """Methods the protocol declares whose named parameters are not the first ones of DeepSpeed's method (so a call
    the type checker accepts, positional or by keyword, means the same to DeepSpeed)."""
    out = []
    for name in sorted(_protocol_members(proto)):
        declared = getattr(proto, name, None)
        if not inspect.isfunction(declared) or not hasattr(engine, name):
            continue  # an attribute (or a missing member, reported as missing)
        real = _deepspeed_method(engine, name)
        ours, theirs = _named_parameters(declared), _named_parameters(real)
        kinds = {p.kind for p in inspect.signature(real).parameters.values()}
        takes_anything = not theirs and {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds
        if theirs[: len(ours)] != ours and not takes_anything:  # (PipelineEngine's disabled backward / step)
            out.append(f"{name}: declared {ours}, DeepSpeed has {theirs}")
    return out


def engine_protocol_members() -> dict[str, Any]:
    """megatron/engine_protocol.py: every member ``Engine`` / ``PipelineEngine`` declare, those a real
    ``DeepSpeedEngine`` / ``PipelineEngine`` lack, and the declared methods whose parameters are not DeepSpeed's."""
    from megatron.engine_protocol import Engine, PipelineEngine

    engines = {
        "plain": (_engine(), Engine),
        "pipe": (_pipeline_engine(F.mse_loss, micro=2, gas=1), PipelineEngine),
    }
    return {
        "declared": {name: sorted(_protocol_members(proto)) for name, (_, proto) in engines.items()},
        "missing": {
            name: sorted(m for m in _protocol_members(proto) if not hasattr(e, m))
            for name, (e, proto) in engines.items()
        },
        "signatures": {name: _signature_mismatches(e, proto) for name, (e, proto) in engines.items()},
    }
