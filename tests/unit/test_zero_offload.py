"""ZeRO-Offload settings as DeepSpeed reads them (megatron/zero_offload.py): the deprecated ``cpu_offload`` flags
GPT-NeoX's Pythia configs write, beside the ``offload_*`` blocks."""

from __future__ import annotations

import pytest
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.errors import ConfigError

TINY = ["configs/cpu/tiny.yml"]


def _zero_block(zero: dict) -> dict:
    return NeoXArgs.from_ymls(TINY, {"zero_optimization": zero}).deepspeed_config["zero_optimization"]


def test_a_false_deprecated_flag_beside_its_block_is_left_out_of_deepspeeds_config() -> None:
    """A Pythia config (``cpu_offload: false``) with an ``offload_optimizer`` block added: DeepSpeed asserts on the
    pair ("Cannot provide deprecated parameter 'cpu_offload' and replacing parameter 'offload_optimizer' together");
    the false flag says nothing, so it is not passed."""
    zero = {"stage": 2, "cpu_offload": False, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(AssertionError, match="Cannot provide deprecated parameter 'cpu_offload'"):
        DeepSpeedZeroConfig(**zero)  # DeepSpeed's own check, on the block as written
    passed = _zero_block(zero)
    assert "cpu_offload" not in passed and passed["offload_optimizer"] == {"device": "cpu"}
    assert DeepSpeedZeroConfig(**passed).offload_optimizer.device == "cpu"
    # alone, as the Pythia configs write it, the flag is passed as written (DeepSpeed accepts it)
    pythia = _zero_block({"stage": 1, "cpu_offload": False})
    assert pythia["cpu_offload"] is False and DeepSpeedZeroConfig(**pythia).offload_optimizer is None
    param = _zero_block({"stage": 3, "cpu_offload_param": False, "offload_param": {"device": "cpu"}})
    assert "cpu_offload_param" not in param and DeepSpeedZeroConfig(**param).offload_param.device == "cpu"


def test_a_true_deprecated_flag_beside_its_block_is_refused() -> None:
    zero = {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
    with pytest.raises(ConfigError) as e:
        NeoXArgs.from_ymls(TINY, {"zero_optimization": zero})
    assert any(
        "sets both cpu_offload: true (deprecated) and offload_optimizer; DeepSpeed refuses the pair: keep "
        "offload_optimizer" in p
        for p in e.value.problems
    )
