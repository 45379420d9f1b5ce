"""RWKV-6 blocks (``attention_config`` type ``rwkv``): GPT-NeoX's parameter names and initialisation, the WKV
recurrence in plain PyTorch (chunked for training, one step per token for generation)."""

from megatron.model.rwkv.layer import RWKV_ChannelMix, RWKV_TimeMix, RWKVResidualLayer, RWKVResidualLayerPipe
from megatron.model.rwkv.state import RWKVLayerState

__all__ = ["RWKVLayerState", "RWKVResidualLayer", "RWKVResidualLayerPipe", "RWKV_ChannelMix", "RWKV_TimeMix"]
