"""benchmarks/bench_recurrent_scan.py's baselines are the recurrences: its per-token loops equal the chunked forms
(ours) on small fp64 inputs, outputs, last states and every input gradient; its gate measures what it says."""

from __future__ import annotations

import torch

from tests.harness import load_tool

BENCH = load_tool("benchmarks/bench_recurrent_scan.py")


def _double(xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(x.double() for x in xs)


def test_mamba_loop_equals_the_chunked_selective_scan() -> None:
    inputs = _double(BENCH.mamba_inputs(2, 6, 37, seed=3))
    gy = torch.randn(2, 6, 37, dtype=torch.float64)
    err = BENCH.max_rel_error(BENCH.fwd_bwd(BENCH.ours_mamba, inputs, gy), BENCH.fwd_bwd(BENCH.mamba_loop, inputs, gy))
    assert err < 1e-5  # the selective scan computes in fp32 whatever its inputs' dtype; the loop stays fp64


def test_wkv_loop_equals_the_chunked_wkv() -> None:
    inputs = _double(BENCH.wkv_inputs(2, 37, 3, n=8, seed=4))
    gy = torch.randn(2, 37, 3, 8, dtype=torch.float64)
    err = BENCH.max_rel_error(BENCH.fwd_bwd(BENCH.ours_wkv, inputs, gy), BENCH.fwd_bwd(BENCH.wkv_loop, inputs, gy))
    assert err < 1e-12


def test_the_gate_sees_a_wrong_loop() -> None:
    inputs = _double(BENCH.wkv_inputs(1, 20, 2, n=4, seed=5))
    gy = torch.randn(1, 20, 2, 4, dtype=torch.float64)

    def off_by_one(*x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, s = BENCH.wkv_loop(*x)
        return torch.cat([y[:, :1] * 0, y[:, :-1]], 1), s

    assert BENCH.max_rel_error(BENCH.fwd_bwd(off_by_one, inputs, gy), BENCH.fwd_bwd(BENCH.wkv_loop, inputs, gy)) > 0.1
