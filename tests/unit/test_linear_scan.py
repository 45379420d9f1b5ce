"""``megatron.model.linear_scan``: every state of ``h_t = a_t h_{t-1} + x_t`` and its gradients equal the token loop,
whatever the chunking (with and without padding), and strong decays neither overflow nor lose the input."""

from __future__ import annotations

import pytest
import torch

from megatron.model.linear_scan import chunk_length, linear_scan


def _loop(a: torch.Tensor, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    out, h = [], h0
    for a_t, x_t in zip(a.unbind(0), x.unbind(0), strict=True):
        h = a_t * h + x_t
        out.append(h)
    return torch.stack(out)


@pytest.mark.parametrize(("length", "chunk"), [(1, None), (7, None), (64, None), (67, None), (50, 1), (50, 7), (9, 20)])
def test_states_and_gradients_equal_the_loop(length: int, chunk: int | None) -> None:
    g = torch.Generator().manual_seed(length)
    a = torch.rand(length, 3, 4, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(length, 3, 4, generator=g, dtype=torch.float64).requires_grad_()
    h0 = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_()
    gh = torch.randn(length, 3, 4, generator=g, dtype=torch.float64)
    got = linear_scan(a, x, h0, chunk)
    want = _loop(a, x, h0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g_got, g_want in zip(
        torch.autograd.grad((got * gh).sum(), (a, x, h0)), torch.autograd.grad((want * gh).sum(), (a, x, h0))
    ):
        torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)


def test_chunk_length_prefers_a_divisor_near_the_square_root() -> None:
    assert chunk_length(2048) == 32 and chunk_length(64) == 8 and chunk_length(8) == 2
    assert chunk_length(67) == 9  # prime: ⌈√67⌉, the last chunk padded
    assert chunk_length(10, 4) == 4 and chunk_length(3, 8) == 3


def test_strong_decay_in_fp32_stays_finite_and_exact() -> None:
    a = torch.full((300, 5), 1e-30)  # each step forgets everything but its own input
    a[::7] = 1.0
    x = torch.randn(300, 5, generator=torch.Generator().manual_seed(0))
    h = linear_scan(a, x, torch.zeros(5))
    assert torch.isfinite(h).all()
    torch.testing.assert_close(h, _loop(a, x, torch.zeros(5)), rtol=1e-6, atol=1e-6)
