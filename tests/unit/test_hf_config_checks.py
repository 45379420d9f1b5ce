"""Every field the HF importer reads from ``config.json`` is type- and range-checked first: one line naming the file,
the field and what is valid, exit 1, no output folder (through the real ``convert_hf_to_neox`` CLI, in-process)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import transformers

from megatron.checkpoint import cli
from megatron.checkpoint.hf_config_checks import check_hf_config
from megatron.checkpoint.layout import CheckpointError
from tests.harness import load_tool

TO_NEOX = load_tool("tools/ckpts/convert_hf_to_neox.py")
NEOX = dict(model_type="gpt_neox", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
            intermediate_size=128, max_position_embeddings=64, layer_norm_eps=1e-5, rotary_pct=0.25,
            use_parallel_residual=True, hidden_act="gelu")  # fmt: skip
PATH = Path("hf/config.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": "64"}, "hidden_size='64' must be an integer between 1 and 2147483647, not a string"),
        ({"hidden_size": 64.0}, "hidden_size=64.0 must be an integer between 1 and 2147483647, not a float"),
        ({"num_hidden_layers": True}, "num_hidden_layers=True must be an integer between 1 and 2147483647, not a bool"),
        ({"num_attention_heads": 0}, "num_attention_heads=0 must be an integer between 1 and 2147483647"),
        ({"vocab_size": -5}, "vocab_size=-5 must be an integer between 1 and 2147483647"),
        ({"vocab_size": 10**30}, "vocab_size=1000000000000000000000000000000 must be an integer between 1 and"),
        ({"intermediate_size": 2**62}, "intermediate_size=4611686018427387904 must be an integer between 1 and"),
        ({"layer_norm_eps": math.inf}, "layer_norm_eps=inf must be a finite number > 0"),
        ({"layer_norm_eps": 0}, "layer_norm_eps=0 must be a finite number > 0"),
        ({"layer_norm_eps": "1e-5"}, "layer_norm_eps='1e-5' must be a finite number > 0, not a string"),
        ({"rms_norm_eps": math.nan}, "rms_norm_eps=nan must be a finite number > 0"),
        ({"rotary_pct": 2.0}, "rotary_pct=2.0 must be a finite number in (0, 1]"),
        ({"rope_theta": "abc"}, "rope_theta='abc' must be a finite number > 0, not a string"),
        ({"rope_parameters": {"rope_theta": -1.0}}, "rope_parameters.rope_theta=-1.0 must be a finite number > 0"),
        ({"rope_parameters": [1]}, "rope_parameters=[1] must be an object, not a list"),
        ({"attention_dropout": 1.0}, "attention_dropout=1.0 must be a finite number in [0, 1)"),
        ({"use_parallel_residual": "yes"}, "use_parallel_residual='yes' must be true or false, not a string"),
        ({"hidden_act": 5}, "hidden_act=5 must be a non-empty string, not an integer"),
        ({"num_attention_heads": 5}, "hidden_size=64 is not divisible by num_attention_heads=5"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 must divide num_attention_heads=4"),
        ({"num_key_value_heads": 8}, "num_key_value_heads=8 must divide num_attention_heads=4"),
        (
            {"num_local_experts": 2, "num_experts_per_tok": 3},
            "num_experts_per_tok=3 must be at most num_local_experts=2",
        ),
        ({"hidden_size": 10**9, "num_attention_heads": 1}, "hidden_size=1000000000 with vocab_size/intermediate_size"),
        ({"hidden_size": "x" * 500}, "hidden_size='xxxxxxxxxxxxxxxxxxxxxxxx"),
    ],
)
def test_bad_field_is_one_line(change: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError) as e:
        check_hf_config(PATH, {**NEOX, **change})
    text = str(e.value)
    assert text.startswith(f"{PATH}: ") and message in text and "\n" not in text and len(text) < 400, text


@pytest.mark.parametrize(
    "change",
    [{}, {"num_key_value_heads": None, "head_dim": None, "sliding_window": None}, {"rope_theta": 10000},
     {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}, {"hidden_size": 48, "head_dim": 16}],
)  # fmt: skip
def test_valid_fields_pass(change: dict[str, Any]) -> None:
    check_hf_config(PATH, {**NEOX, **change})


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "neox"
    config = transformers.GPTNeoXConfig(**{k: v for k, v in NEOX.items() if k != "model_type"})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", "64", "hidden_size='64' must be an integer"),
        ("num_attention_heads", 0, "num_attention_heads=0 must be an integer between 1"),
        ("layer_norm_eps", math.inf, "layer_norm_eps=inf must be a finite number > 0"),
        (
            "hidden_size",
            10**9,
            "hidden_size=1000000000 with vocab_size/intermediate_size/heads implies a weight matrix",
        ),
    ],
)
def test_converter_refuses_the_config_in_one_line(
    hf_folder: Path, tmp_path: Path, field: str, value: Any, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf_folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, field: value}))  # Infinity: Python's JSON extension
    out = tmp_path / "out"
    capsys.readouterr()
    assert cli.run(lambda: TO_NEOX.main(["--input_dir", str(bad), "--output_dir", str(out)])) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: {bad / 'config.json'}: {err.split(': ', 2)[2]}" and message in err, err
    assert "Traceback" not in err and not out.exists()
