"""Half precision on a CPU without native kernels for it is flagged once, with the fix; fp32 never is."""

from __future__ import annotations

import logging

import pytest

from megatron.cpu_features import CPU_FLAGS, cpu_has_native, cpuinfo_flags
from megatron.training import cpu_precision
from megatron.training.cpu_precision import slow_half_precision_warning


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_native_probe_agrees_with_the_cpu_flags(dtype: str) -> None:
    flags = cpuinfo_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this machine")
    assert cpu_has_native(dtype) == bool(flags & set(CPU_FLAGS[dtype]))


def test_warning_names_the_dtype_the_cpu_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(cpu_precision, "cpu_has_native", lambda dtype: False)
    msg = slow_half_precision_warning({"bf16": {"enabled": True}})
    assert msg is not None
    assert msg.startswith("bf16 on this CPU") and "avx512_bf16" in msg and "bf16: {enabled: false}" in msg
    assert slow_half_precision_warning({"fp16": {"enabled": True}, "bf16": {"enabled": False}}).startswith("fp16")


def test_no_warning_for_fp32_or_native_half(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert slow_half_precision_warning({"bf16": {"enabled": False}}) is None
    assert slow_half_precision_warning({}) is None
    monkeypatch.setattr(cpu_precision, "cpu_has_native", lambda dtype: True)
    assert slow_half_precision_warning({"bf16": {"enabled": True}}) is None


def test_fp16_is_refused_only_on_a_cpu_without_native_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's CPU accelerator accepts fp16 where oneDNN has native fp16 kernels (the same probe as
    ``cpu_has_native``): there fp16 trains as configured; elsewhere it is one error naming the opt-in."""
    from megatron.neox_arguments.errors import ConfigError

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv(cpu_precision.ALLOW_CPU_FP16_ENV, raising=False)
    allowed: list[bool] = []
    monkeypatch.setattr(cpu_precision, "allow_fp16_on_cpu", lambda: allowed.append(True))
    fp16 = {"fp16": {"enabled": True}}
    monkeypatch.setattr(cpu_precision, "cpu_has_native", lambda dtype: True)
    cpu_precision.apply_cpu_precision(fp16)  # native: no error, no override of DeepSpeed's own answer
    assert not allowed
    monkeypatch.setattr(cpu_precision, "cpu_has_native", lambda dtype: False)
    with pytest.raises(ConfigError, match=r"no avx512_fp16 / amx_fp16.*NEOX_FORGE_ALLOW_CPU_FP16=1"):
        cpu_precision.apply_cpu_precision(fp16)
    monkeypatch.setenv(cpu_precision.ALLOW_CPU_FP16_ENV, "1")
    cpu_precision.apply_cpu_precision(fp16)
    assert allowed == [True]


def test_resolving_an_fp16_config_on_a_cpu_claims_no_refusal(caplog: pytest.LogCaptureFixture) -> None:
    """The config layer leaves fp16 on the CPU to the ranks' check above (fp16 trains on a CPU with native fp16);
    it used to warn that DeepSpeed refuses fp16 on every CPU."""
    from megatron.neox_arguments import LaunchEnv, NeoXArgs

    values = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32}
    values |= {"max_position_embeddings": 32, "train_iters": 4, "train_micro_batch_size_per_gpu": 2}
    with caplog.at_level(logging.WARNING):
        args = NeoXArgs({**values, "fp16": {"enabled": True}}, env=LaunchEnv(world_size=1, on_cpu=True))
    assert args.precision == "fp16"
    assert "refuses" not in caplog.text and "no CPU kernels" not in caplog.text, caplog.text
