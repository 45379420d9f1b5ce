"""The Python API GPT-NeoX users and GPT-NeoX's own tools script against, with GPT-NeoX's keyword names."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.harness import REPO_ROOT

TINY = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "max_position_embeddings": 32,
    "train_micro_batch_size_per_gpu": 2,
    "global_num_gpus": 1,
}


def _tool(relpath: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(relpath).stem, REPO_ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_from_megatron_import_neoxargs_and_gpt_neox_keyword_names(tmp_path, monkeypatch):
    from megatron import NeoXArgs
    from megatron.neox_arguments import NeoXArgs as Same

    assert NeoXArgs is Same
    args = NeoXArgs.from_dict(args_dict=TINY)
    assert args.hidden_size == 64

    cfg = tmp_path / "tiny.yml"
    cfg.write_text(yaml.safe_dump(TINY))
    deepy = NeoXArgs.consume_deepy_args(input_args=[str(REPO_ROOT / "train.py"), str(cfg), "--train_iters", "7"])
    assert deepy.train_iters == 7 and deepy.user_script.endswith("train.py")

    # current GPT-NeoX passes --megatron_config as a JSON file path; older versions as base64 (tested elsewhere)
    path = tmp_path / "megatron_config.json"
    path.write_text(json.dumps(args.to_dict()))
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    worker = NeoXArgs.consume_neox_args(
        overwrite_values={"train_iters": 9}, input_args=["--megatron_config", str(path)]
    )
    assert worker.train_iters == 9 and (worker.rank, worker.local_rank, worker.world_size) == (0, 0, 1)

    monkeypatch.setenv("LOCAL_RANK", "0")
    args.configure_distributed_args()
    assert (args.rank, args.world_size) == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    from megatron.neox_arguments import ConfigError

    with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
        args.configure_distributed_args()


def test_fused_kernels_build_path_is_accepted_and_warned_about(caplog):
    from megatron import NeoXArgs

    with caplog.at_level(logging.WARNING, logger="megatron.neox_arguments.neox_args"):
        args = NeoXArgs.from_dict({**TINY, "fused_kernels_build_path": "/tmp/kernels"})
    assert args.fused_kernels_build_path == "/tmp/kernels"
    assert any("fused_kernels_build_path='/tmp/kernels' is ignored" in r.message for r in caplog.records)


def test_sm3_with_fp16_is_accepted():
    from megatron import NeoXArgs

    args = NeoXArgs.from_dict({**TINY, "optimizer": {"type": "sm3", "params": {}}, "fp16": {"enabled": True}})
    assert args.optimizer_type == "sm3" and args.precision == "fp16"


def test_preprocess_data_main_raises_like_gpt_neox(tmp_path):
    tool = _tool("tools/datasets/preprocess_data.py")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    argv = ["--input", str(bad), "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "CharLevelTokenizer"]
    assert tool.get_args(argv).input == str(bad)
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        tool.main(input_args=argv)
    assert not list(tmp_path.glob("x*"))


def test_train_tokenizer_parse_args_then_main(tmp_path):
    tool = _tool("tools/datasets/train_tokenizer.py")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"def f{i}(x): return x * {i}"}) + "\n" for i in range(50))
    )
    out = tmp_path / "tok.json"
    args = tool.parse_args(["--json_input_dir", str(docs), "--tokenizer_output_path", str(out), "--vocab_size", "300"])
    tool.main(args)
    assert json.loads(out.read_text())["model"]["type"] == "BPE"
    with pytest.raises(ValueError):
        tool.main(tool.parse_args(["--json_input_dir", str(tmp_path / "none"), "--tokenizer_output_path", str(out)]))
