"""GPT-NeoX's configuration system: typed sections, YAML/JSON loading, derivation and validation."""

from megatron.neox_arguments.derive import LaunchEnv, padded_vocab_size
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.namespace import default_values, neox_namespace
from megatron.neox_arguments.neox_args import KNOWN_KEYS, NeoXArgs

__all__ = [
    "KNOWN_KEYS",
    "ConfigError",
    "LaunchEnv",
    "NeoXArgs",
    "default_values",
    "neox_namespace",
    "padded_vocab_size",
]
