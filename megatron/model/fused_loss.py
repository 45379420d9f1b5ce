"""Output projection and LM cross entropy fused and chunked over tokens (tensor parallel size 1).

The unfused path materialises the logits ``[b, s, V]`` (412 MB in fp32 for 2048 tokens × 50k vocabulary), then
the loss makes several more passes over tensors of that size, and the backward allocates two more. Here the
tokens are processed in chunks of ``chunk_rows``: per chunk, ``logits = h W^T`` goes into one reused buffer, the
loss is ``logsumexp - logit[target]``, and the gradient ``(softmax - onehot) · mask / Σmask`` is formed in place
and turned at once into the chunk's hidden-state gradient (``G W``) and added to the weight gradient
(``G^T h``). The backward only scales those two by the incoming gradient. Same loss as
:func:`megatron.model.gpt2_model.cross_entropy` on the same logits (masked mean, fp32 softmax); the FLOPs are
those of the unfused forward + backward.
"""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_CHUNK_ROWS = 256


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        loss_mask: torch.Tensor,
        chunk_rows: int,
        need_grad: bool,
    ) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])  # [N, h]
        tgt = target.reshape(-1)
        mask = loss_mask.reshape(-1).float()
        denom = mask.sum()
        coef = mask / denom  # d loss / d token-loss
        n, vocab = h.shape[0], weight.shape[0]
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        w32 = weight if weight.dtype == torch.float32 else None
        rows = max(1, min(chunk_rows, n))
        buf = torch.empty(rows, vocab, dtype=weight.dtype, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=weight.device)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            hc, tc = h[start:end], tgt[start:end]
            logits = torch.mm(hc, weight.t(), out=buf[: end - start])
            z = logits if logits.dtype == torch.float32 else logits.float()
            target_logit = z.gather(1, tc.unsqueeze(1)).squeeze(1)
            zmax = z.amax(dim=1, keepdim=True)
            z.sub_(zmax).exp_()
            sum_exp = z.sum(dim=1)
            losses = sum_exp.log() + zmax.squeeze(1) - target_logit
            total += (losses * coef[start:end]).sum()
            if grad_h is None or grad_w is None:  # not need_grad
                continue
            # gradient of the masked mean w.r.t. these logits: (softmax - onehot) * coef
            z.mul_((coef[start:end] / sum_exp).unsqueeze(1))
            z.scatter_add_(1, tc.unsqueeze(1), -coef[start:end].unsqueeze(1))
            g = z if weight.dtype == torch.float32 else z.to(weight.dtype)
            torch.mm(g, weight, out=grad_h[start:end])
            grad_w.addmm_(g.t().float() if w32 is None else g.t(), hc.float() if w32 is None else hc)
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        grad_h, grad_w = ctx.saved_tensors
        gh = (grad_h * grad_out.to(grad_h.dtype)).view(ctx.hidden_shape) if ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None


def fused_lm_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    loss_mask: torch.Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """Masked-mean LM loss of ``hidden`` [b, s, h] against ``weight`` [V, h] for ``target`` [b, s]."""
    if tuple(target.shape) != tuple(hidden.shape[:-1]) or tuple(loss_mask.shape) != tuple(target.shape):
        raise ValueError(
            f"fused_lm_cross_entropy: hidden {tuple(hidden.shape)}, target {tuple(target.shape)} and loss_mask "
            f"{tuple(loss_mask.shape)} must agree on [b, s]"
        )
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearCrossEntropy.apply(hidden, weight, target, loss_mask, chunk_rows, need_grad)
