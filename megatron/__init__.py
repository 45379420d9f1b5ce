"""neox-forge: a GPT-NeoX-compatible training framework (the ``megatron`` package keeps GPT-NeoX's name)."""

__version__ = "0.1.0"
