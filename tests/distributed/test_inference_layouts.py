"""Generation and evaluation under the training layout: TP=2, PP=2 and TP=2 x PP=2 on 4 gloo ranks give the
1-rank tokens (fp32; and bf16 weights kept bf16 under PP=2), the 1-rank eval.py metrics and the 1-rank
``text_gen_type: precompute`` log-probs.

The tiny checkpoint is saved TP=2 / PP=2 (convert_hf_to_neox.py); each rank builds only its pipeline stage's
layers as its TP shards (the same layer classes as training) and the last stage's tokens drive every rank.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.distributed import fns_inference
from tests.e2e.eval_fixture import build_tiny_model
from tests.harness import REPO_ROOT as REPO
from tests.harness import free_port, run_command, run_distributed

pytestmark = pytest.mark.distributed

PROMPTS = ["The quick brown", "To be, or not", "Q: What is 2 plus 2?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), tp=2, pp=2)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, list[dict]]]:
    """(overrides, {precision: records}) of generation on one process (the TP/PP checkpoint merged).

    bf16 weights stay bf16 (not upcast); ``inference_precision: fp32`` upcasts them and gives the fp32 tokens.
    """
    import torch

    from megatron.generation.config import InferenceConfig
    from megatron.generation.text_generation import run_generation, setup_for_inference
    from megatron.neox_arguments import NeoXArgs

    root = tmp_path_factory.mktemp("ref")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    overrides = {"text_gen_type": "input-file", "sample_input_file": str(prompts), "maximum_tokens": 6,
                 "sample_output_file": str(root / "out.jsonl"), "return_logits": True}  # fmt: skip
    records = {}
    for precision in ("fp32", "bfloat16"):
        values = {**overrides, "precision": precision}
        records[precision] = run_generation(NeoXArgs.from_ymls(tiny.configs, overwrite_values=values))
        assert [r["context"] for r in records[precision]] == PROMPTS
        assert sum(r["length"] for r in records[precision]) >= 6
    bf16 = {**overrides, "precision": "bfloat16"}
    model, _ = setup_for_inference(
        InferenceConfig.from_neox_args(NeoXArgs.from_ymls(tiny.configs, overwrite_values=bf16))
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    upcast = {**bf16, "inference_precision": "fp32"}
    model, _ = setup_for_inference(
        InferenceConfig.from_neox_args(NeoXArgs.from_ymls(tiny.configs, overwrite_values=upcast))
    )
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert _tokens(run_generation(NeoXArgs.from_ymls(tiny.configs, overwrite_values=upcast))) == _tokens(
        records["fp32"]
    )
    return overrides, records


def _tokens(records: list[dict]) -> list[tuple]:
    return [(r["context"], r["text"], r["length"], r["finished"]) for r in records]


GEN_LAYOUTS = [(2, 1, "fp32"), (1, 2, "fp32"), (2, 2, "fp32"), (1, 2, "bfloat16")]
EVAL_LAYOUTS = [(2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def eval_reference(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, float], Path]:
    """(overrides, metrics) of eval.py's code path on one process, on the shipped local tasks (eval_limit 3)."""
    from megatron.evaluation.standalone import evaluate_checkpoint
    from megatron.neox_arguments import NeoXArgs

    root = tmp_path_factory.mktemp("eval")
    overrides = {"eval_tasks": [str(REPO / "configs" / "eval")], "eval_limit": 3, "eval_results_prefix": "tiny"}
    saved, cwd = dict(os.environ), os.getcwd()
    os.environ.update(HF_HOME=str(root / "hf_home"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    try:
        os.chdir(root)
        path, metrics = evaluate_checkpoint(NeoXArgs.from_ymls(tiny.configs, overwrite_values=overrides))
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
    assert path is not None and len(metrics) >= 3
    return overrides, metrics, root


PRE_LAYOUTS = [(2, 1), (1, 2), (2, 2)]
DOCS = [[5, 9, 30, 7, 2], list(range(1, 80)), [11], list(range(200, 240)), [3, 4]]  # cut and padded to 33 tokens


@pytest.fixture(scope="module")
def precompute_reference(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """(overrides, output prefix) of ``text_gen_type: precompute`` on one process (the TP/PP checkpoint merged)."""
    import numpy as np

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    from megatron.generation.text_generation import run_generation
    from megatron.neox_arguments import NeoXArgs

    prefix = str(tmp_path_factory.mktemp("pre") / "d_text_document")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in DOCS:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    overrides = {"text_gen_type": "precompute", "train_data_paths": [prefix], "valid_data_paths": [prefix],
                 "test_data_paths": [prefix], "seq_length": 32}  # fmt: skip
    records = run_generation(
        NeoXArgs.from_ymls(tiny.configs, overwrite_values={**overrides, "precompute_model_name": "one"})
    )
    assert records == [{"precomputed": f"{prefix}_one"}] * 3
    return overrides, f"{prefix}_one"


@pytest.fixture(scope="module")
def layouts(
    tiny, reference, eval_reference, precompute_reference, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    """Every rank's results of generation, evaluation and precompute under each layout, from one 4-rank world."""
    out = tmp_path_factory.mktemp("ranks")
    evl = {**eval_reference[0], "eval_results_prefix": "ranks"}
    return run_distributed(fns_inference.run_all, 4, tiny.configs, reference[0], GEN_LAYOUTS, evl, EVAL_LAYOUTS,
                           str(out), precompute_reference[0], PRE_LAYOUTS, timeout=400)  # fmt: skip


def test_generation_on_tp_and_pp_ranks_matches_one_rank(reference, layouts) -> None:
    references = reference[1]
    results = [r["generate"] for r in layouts]
    for tp, pp, precision in GEN_LAYOUTS:
        name, reference = f"tp{tp}_pp{pp}_{precision}", references[precision]
        assert all(r[name]["dtypes"] == [f"torch.{'float32' if precision == 'fp32' else precision}"] for r in results)
        assert sorted((r[name]["stage"], r[name]["tp_rank"]) for r in results) == sorted(
            (rank // tp % pp if pp > 1 else 0, rank % tp) for rank in range(4)
        ), name
        got = results[0][name]["records"]
        assert all(r[name]["records"] == [] for r in results[1:]), name  # only rank 0 returns / writes records
        for mine, want in zip(got, reference, strict=True):
            assert (mine["context"], mine["text"], mine["length"], mine["finished"]) == (
                want["context"], want["text"], want["length"], want["finished"]
            ), name  # fmt: skip
            assert len(mine["logits"]) == len(want["logits"])
            tol = 1e-4 if precision == "fp32" else 1e-6  # bf16: the same kernels on one stage or two
            for a, b in zip(mine["logits"], want["logits"], strict=True):
                assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol, name


def test_eval_on_tp_and_pp_ranks_matches_one_rank(eval_reference, layouts) -> None:
    """eval.py's path with TP=2 (DP=2), PP=2 (DP=2) and TP=2 x PP=2: the 1-rank metrics; rank 0 writes the file."""
    _, metrics, _ = eval_reference
    for tp, pp in EVAL_LAYOUTS:
        name = f"tp{tp}_pp{pp}"
        got = [r["eval"][name] for r in layouts]
        assert got[0]["path"] is not None and Path(got[0]["path"]).name.startswith("ranks_eval_results_")
        assert all(g["path"] is None for g in got[1:]) and got[0]["dp"] == 4 // (tp * pp)
        for key, value in metrics.items():
            same = got[0]["metrics"][key] == value if "acc" in key or "exact_match" in key else math.isclose(
                got[0]["metrics"][key], value, rel_tol=1e-5, abs_tol=1e-5
            )  # fmt: skip
            assert same, (name, key, got[0]["metrics"][key], value)
        assert set(got[0]["metrics"]) == set(metrics)


def test_generate_py_through_deepy_on_two_pipeline_stages(tiny, reference, tmp_path: Path) -> None:
    """``python deepy.py generate.py cfg.yml`` with pipe_parallel_size 2 on 2 ranks writes the 1-rank samples."""
    overrides, records = reference[0], reference[1]["fp32"]
    cfg: dict = {}
    for name in tiny.configs:
        cfg.update(yaml.safe_load(Path(name).read_text()))
    cfg.pop("global_num_gpus")
    out = tmp_path / "samples.jsonl"
    cfg.update(overrides, num_gpus=2, model_parallel_size=1, pipe_parallel_size=2, master_port=free_port(),
               sample_output_file=str(out), return_logits=False)  # fmt: skip
    config = tmp_path / "gen.yml"
    config.write_text(yaml.safe_dump(cfg))
    log = run_command([sys.executable, str(REPO / "deepy.py"), str(REPO / "generate.py"), str(config)],
                      timeout=300, cwd=tmp_path).stdout  # fmt: skip
    assert "pipeline stage 1/2" in log and "pipeline stage 0/2" in log  # both ranks built their own stage
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(w["context"], w["text"], w["length"]) for w in written] == [
        (r["context"], r["text"], r["length"]) for r in records
    ]


def test_interactive_generate_py_through_deepy_on_two_tensor_parallel_ranks(tiny, reference, tmp_path: Path) -> None:
    """``text_gen_type: interactive`` at TP=2: rank 0 reads the prompts from stdin and shares them, both ranks
    generate, and each completion is printed once, equal to the 1-rank text; end of input ends the session."""
    overrides, records = reference[0], reference[1]["fp32"]
    cfg: dict = {}
    for name in tiny.configs:
        cfg.update(yaml.safe_load(Path(name).read_text()))
    cfg.pop("global_num_gpus")
    cfg.update({k: v for k, v in overrides.items() if k not in ("sample_input_file", "sample_output_file")})
    cfg.update(text_gen_type="interactive", num_gpus=2, model_parallel_size=2, pipe_parallel_size=0,
               master_port=free_port(), return_logits=False)  # fmt: skip
    config = tmp_path / "interactive.yml"
    config.write_text(yaml.safe_dump(cfg))
    stdin = "".join(p + "\n" for p in PROMPTS)
    log = run_command([sys.executable, str(REPO / "deepy.py"), str(REPO / "generate.py"), str(config)],
                      timeout=300, cwd=tmp_path, input_text=stdin).stdout  # fmt: skip
    assert "x model 2" in log  # the model-parallel groups of TP=2 were set up
    printed = re.findall(r"^Generated Text: (.*)$", log, flags=re.MULTILINE)
    assert printed == [(r["text"] or "").split("\n")[0] for r in records], log[-3000:]


def test_precompute_on_tp_and_pp_ranks_matches_one_rank(precompute_reference, layouts) -> None:
    """text_gen_type precompute with TP=2 (DP=2), PP=2 (DP=2) and TP=2 x PP=2: rank 0 alone writes
    ``<prefix>_<name>.bin/.idx`` (no temporary file left), float32 log-probs equal to one process's within 1e-5."""
    import numpy as np

    from megatron.data.indexed_dataset import make_dataset

    one = make_dataset(precompute_reference[1])
    assert len(one) == len(DOCS) and one.dtype == np.float32
    prefix = precompute_reference[1].removesuffix("_one")
    for tp, pp in PRE_LAYOUTS:
        name = f"tp{tp}_pp{pp}"
        results = [r["precompute"][name] for r in layouts]
        assert sorted((r["stage"], r["tp_rank"]) for r in results) == sorted(
            (rank // tp % pp if pp > 1 else 0, rank % tp) for rank in range(4)
        ), name  # every rank scored with its own stage's TP shard
        assert results[0]["records"] == [{"precomputed": f"{prefix}_{name}"}] * 3
        assert all(r["records"] == [] for r in results[1:]), name
        got = make_dataset(f"{prefix}_{name}")
        assert len(got) == len(DOCS) and got.dtype == np.float32, name
        for i in range(len(DOCS)):
            assert got[i].shape == (32,) and np.abs(got[i] - one[i]).max() <= 1e-5, (name, i)
    assert not list(Path(prefix).parent.glob("*tmp*")), "temporary precompute files left behind"


def test_a_stage_reads_only_its_own_files(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_checkpoint(keep_for=...)``, what each generation rank runs: only the kept specs' layer files are
    loaded (plus layer 00's TP-rank-0 file, memory-mapped, for the vocabulary size) and the kept tensors equal a
    full read's."""
    import torch

    import megatron.checkpoint.reader as reader

    full = reader.read_checkpoint(tiny.neox)
    assert full.layout.is_pipe and full.layout.tp == 2
    loaded: list[str] = []
    load = reader.load_torch

    def recording_load(path: Path, mmap: bool = False) -> object:
        loaded.append(Path(path).name + (" (mmap)" if mmap else ""))
        return load(path, mmap)

    monkeypatch.setattr(reader, "load_torch", recording_load)
    part = reader.read_checkpoint(tiny.neox, keep_for=lambda cfg: lambda key: key.startswith("sequential.3."))
    assert part.cfg == full.cfg
    assert sorted(part.state_dict) == sorted(k for k in full.state_dict if k.startswith("sequential.3."))
    assert part.state_dict and all(torch.equal(part.state_dict[k], full.state_dict[k]) for k in part.state_dict)
    layer_files = sorted(n for n in loaded if n.startswith("layer_"))
    assert layer_files == ["layer_00-model_00-model_states.pt (mmap)", "layer_03-model_00-model_states.pt",
                           "layer_03-model_01-model_states.pt"], loaded  # fmt: skip


@pytest.mark.parametrize("file_layout", ["pipe", "sequential"])
def test_a_tp_rank_reads_only_its_own_shards(tiny, file_layout: str, tmp_path: Path, monkeypatch) -> None:
    """``read_checkpoint(tp_shard=(rank, 2))`` on a TP=2 checkpoint: each rank's tensors equal the merged model cut
    for that rank (row-parallel biases stored as per-rank shares summed), with every file memory-mapped, in the
    pipeline and in the sequential file layout; another TP size gets the full tensors."""
    import torch

    import megatron.checkpoint.reader as reader
    from megatron.checkpoint.bias_layout import is_row_bias
    from megatron.checkpoint.reshard import reshard_checkpoint
    from megatron.checkpoint.writer import TargetLayout
    from megatron.model.tp_sharding import shard_state_dict

    src = tiny.neox
    if file_layout == "sequential":
        reshard_checkpoint(tiny.neox, tmp_path / "seq", TargetLayout(tp=2, pp=0))
        src = tmp_path / "seq"
    full = reader.read_checkpoint(src)
    assert full.layout.is_pipe == (file_layout == "pipe") and full.layout.tp == 2
    assert any(is_row_bias(k) for k in full.state_dict)
    loaded: list[bool] = []
    load = reader.load_torch

    def recording_load(path: Path, mmap: bool = False) -> object:
        loaded.append(mmap)
        return load(path, mmap)

    monkeypatch.setattr(reader, "load_torch", recording_load)
    for rank in (0, 1):
        own = reader.read_checkpoint(src, tp_shard=(rank, 2))
        assert own.tp_shard == (rank, 2) and own.cfg == full.cfg
        expected = shard_state_dict(full.state_dict, full.cfg, rank, 2)
        assert sorted(own.state_dict) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(own.state_dict[key], value), key
    assert loaded and all(loaded)  # every file memory-mapped
    other = reader.read_checkpoint(src, tp_shard=(0, 4))
    assert other.tp_shard is None and all(torch.equal(other.state_dict[k], v) for k, v in full.state_dict.items())
