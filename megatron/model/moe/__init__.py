"""Dropless mixture of experts (GPT-NeoX's ``moe_*`` keys): routers, experts sharded over the TP group, the
load-balancing loss and router statistics. See docs/moe.md."""

from megatron.model.moe.aux_loss import load_balancing_loss
from megatron.model.moe.layer import ParallelDroplessMoE
from megatron.model.moe.model_view import moe_layers, moe_metrics, with_aux_loss

__all__ = ["ParallelDroplessMoE", "load_balancing_loss", "moe_layers", "moe_metrics", "with_aux_loss"]
