"""Hostile Hugging Face folders through the commands a user runs: ``convert_hf_to_neox.py``,
``preprocess_data_with_chat_template.py --tokenizer-path`` and ``convert_neox_to_hf.py``.

A folder asking to run its own code (``auto_map``) is refused even when the user would answer "y"; a
``config.json`` contradicting the weights, a tokenizer larger than ``vocab_size``, malformed safetensors and a bad
sharded index are one-line errors, exit 1, no output folder; exported files follow the umask.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import transformers
import yaml

from tests.harness import PYTHON, REPO_ROOT, run_command
from tests.unit.test_ckpt_hf import CASES, TO_HF, TO_NEOX, _hf_model, _run, _tokenizer

PAYLOAD = """from pathlib import Path
Path({marker!r}).write_text("the folder's code ran")
from transformers import PretrainedConfig
class EvilConfig(PretrainedConfig):
    model_type = "evil"
"""


def _plant_code(folder: Path, marker: Path, json_name: str, auto_map: dict) -> None:
    (folder / "evil_code.py").write_text(PAYLOAD.format(marker=str(marker)))
    path = folder / json_name
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, "auto_map": auto_map}))


def _one_line_error(stderr: str, *needles: str) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_auto_map_folders_run_no_code_even_after_yes(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    model = tmp_path / "model"
    _hf_model(CASES["neox-sequential-tied"][1], model)
    _plant_code(model, marker, "config.json", {"AutoConfig": "evil_code.EvilConfig"})
    out = tmp_path / "neox"
    tool = str(REPO_ROOT / "tools" / "ckpts" / "convert_hf_to_neox.py")
    r = run_command([PYTHON, tool, "--input_dir", str(model), "--output_dir", str(out)], check=False, input_text="y\n")
    assert r.returncode == 1, r.describe()
    _one_line_error(r.stderr, f"{model / 'config.json'}: auto_map names custom code (evil_code.EvilConfig)")
    assert not out.exists() and not marker.exists()

    tok = tmp_path / "tok"
    _tokenizer(tok).save_pretrained(str(tok))
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tok / "tokenizer_config.json").write_text(json.dumps(config))  # usable but for its auto_map
    _plant_code(tok, marker, "tokenizer_config.json", {"AutoTokenizer": ["evil_code.EvilTok", None]})
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    tool = str(REPO_ROOT / "tools" / "datasets" / "preprocess_data_with_chat_template.py")
    argv = [PYTHON, tool, "--input", str(data), "--output-prefix", str(tmp_path / "sft"), "--tokenizer-path", str(tok)]
    r = run_command(argv, check=False, input_text="y\n")
    assert r.returncode == 1, r.describe()
    _one_line_error(r.stderr, f"--tokenizer-path {tok}", "never runs a tokenizer folder's code")
    assert not marker.exists() and not list(tmp_path.glob("sft*"))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "llama"
    _hf_model(CASES["llama-gqa"][1], folder)
    return folder


def _copy(src: Path, dst: Path, config: dict | None = None) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    if config:
        (dst / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    return dst


def _refused(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    out = tmp_path / f"out-{folder.name}"
    assert _run(TO_NEOX, ["--input_dir", str(folder), "--output_dir", str(out)]) == 1
    _one_line_error(capsys.readouterr().err, *needles)
    assert not out.exists() and not list(tmp_path.glob(f".{out.name}*"))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"hidden_size": 32, "num_attention_heads": 2}, "tensor lm_head.weight has shape (128, 64) but"),
        ({"num_hidden_layers": 1}, "the weights hold layers 0..1 but"),
        ({"intermediate_size": 80}, "down_proj.weight has shape (64, 96) but"),
        ({"vocab_size": 256}, "implies (256, 64)"),
        ({"num_key_value_heads": 4}, "self_attn.k_proj.weight has shape (32, 64)"),
    ],
)
def test_config_sizes_must_match_the_weights(
    hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, needle: str
) -> None:
    folder = _copy(hf_folder, tmp_path / "bad", change)
    _refused(folder, tmp_path, capsys, needle, str(folder / "config.json"))


def test_tokenizer_larger_than_vocab_size_is_refused(
    hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy(hf_folder, tmp_path / "big-tok")
    tok = _tokenizer(folder)
    tok.add_tokens([f"<extra_{i}>" for i in range(200)])
    tok.save_pretrained(str(folder))
    _refused(folder, tmp_path, capsys, f"tokenizer.json has {len(tok)} tokens but", "vocab_size=128")


def _header(path: Path, raw: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


@pytest.mark.parametrize("damage", ["truncated", "huge-length", "not-json", "not-object", "short"])
def test_malformed_safetensors_is_one_line(
    hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    folder = _copy(hf_folder, tmp_path / damage)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    needle = {
        "truncated": "(truncated file?)",
        "huge-length": "safetensors header length 18446744073709551615 exceeds the file",
        "not-json": "safetensors header is not valid JSON",
        "not-object": "safetensors header must be a JSON object, not list",
        "short": "not a safetensors file: 5 bytes",
    }[damage]
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "huge-length":
        weights.write_bytes(b"\xff" * 8 + data[8:])
    elif damage == "not-json":
        _header(weights, b"{not json" + b" " * 16)
    elif damage == "not-object":
        _header(weights, b"[1, 2]")
    else:
        weights.write_bytes(b"12345")
    _refused(folder, tmp_path, capsys, str(weights), needle)


@pytest.mark.parametrize(
    ("weight_map", "needle"),
    [
        (["model.safetensors"], "weight_map must be a non-empty object of tensor name -> shard file, got a list"),
        ({"model.embed_tokens.weight": 7}, "weight_map['model.embed_tokens.weight'] = 7 is not a shard file name"),
        ({"model.embed_tokens.weight": "../elsewhere.safetensors"}, "which is outside"),
    ],
)
def test_bad_sharded_index_is_one_line(
    hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], weight_map: object, needle: str
) -> None:
    folder = _copy(hf_folder, tmp_path / "sharded")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _refused(folder, tmp_path, capsys, "model.safetensors.index.json", needle)
    (folder / "model.safetensors.index.json").write_text("[1, 2]")
    _refused(folder, tmp_path, capsys, "model.safetensors.index.json must hold a JSON object, not list")


def test_exported_files_follow_the_umask(hf_folder: Path, tmp_path: Path) -> None:
    neox, back = tmp_path / "neox", tmp_path / "back"
    previous = os.umask(0o022)
    try:
        assert _run(TO_NEOX, ["--input_dir", str(hf_folder), "--output_dir", str(neox)]) == 0
        assert _run(TO_HF, ["--input_dir", str(neox), "--output_dir", str(back), "--architecture", "llama"]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in back.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    assert transformers.AutoConfig.from_pretrained(str(back), trust_remote_code=False).model_type == "llama"


def test_converted_checkpoint_records_its_tokenizer(hf_folder: Path, tmp_path: Path) -> None:
    """The identity a training run compares on finetune: that of the copied tokenizer.json (tokenizer.yml)."""
    import torch

    from megatron.checkpoint.tokenizer_identity import tokenizer_identity
    from megatron.tokenizer.tokenizer import HFTokenizer

    folder = _copy(hf_folder, tmp_path / "with-tok")
    _tokenizer(folder)
    neox = tmp_path / "neox"
    assert _run(TO_NEOX, ["--input_dir", str(folder), "--output_dir", str(neox)]) == 0
    args = torch.load(neox / "global_step0" / "mp_rank_00_model_states.pt", weights_only=False)["args"]
    copied = yaml.safe_load((neox / "tokenizer.yml").read_text())["vocab_file"]
    assert {k: args[k] for k in ("tokenizer_vocab_file", "tokenizer_vocab_sha256", "tokenizer_vocab_size")} == (
        tokenizer_identity(HFTokenizer(copied), copied)
    )


def test_nonfinite_weight_in_a_pipeline_shard_is_traced_to_its_file(
    hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    neox, out = tmp_path / "neox", tmp_path / "back"
    assert _run(TO_NEOX, ["--input_dir", str(hf_folder), "--output_dir", str(neox), "--tp", "2", "--pp", "1"]) == 0
    shard = neox / "global_step0" / "layer_03-model_01-model_states.pt"
    state = torch.load(shard, weights_only=True)
    state["attention.dense.weight"][0, 1] = float("inf")
    torch.save(state, shard)
    capsys.readouterr()
    assert _run(TO_HF, ["--input_dir", str(neox), "--output_dir", str(out), "--architecture", "llama"]) == 1
    _one_line_error(capsys.readouterr().err, f"{shard}: tensor sequential.3.attention.dense.weight holds 1 NaN/inf")
    assert not out.exists()
