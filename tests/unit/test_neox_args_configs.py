"""Every real GPT-NeoX config loads and validates, or fails with the one expected error; shipped configs load."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import yaml

from megatron.neox_arguments import ConfigError, LaunchEnv, NeoXArgs
from tests import shared_files

REPO = Path(__file__).resolve().parents[2]
REF = str(shared_files.SHARED / "reference" / "gpt-neox-configs")
ENV = LaunchEnv(world_size=None, on_cpu=True)

SETUP = "local_setup.yml"
LLAMA_TRAIN = "llama/train_config.yml"
# config -> (files merged after it, expected outcome). Outcomes: "ok", "not supported yet: <feature>",
# "unknown key '<key>'" (keys GPT-NeoX rejects as well), "set in two files" (a duplicate GPT-NeoX misses, §12.1).
EXPECTED: dict[str, tuple[list[str], str]] = {
    **{f"{m}.yml": ([SETUP], "ok") for m in ("19M", "49M", "125M", "350M", "760M", "800M", "1-3B", "2-7B", "6-7B")},
    **{f"{m}.yml": ([SETUP], "ok") for m in ("13B", "175B", "125M-json", "bf16_125M", "slurm_125M")},
    "20B.yml": ([], "ok"),  # sets its own data, tokenizer and checkpoint paths
    **{f"pythia/{m}.yml": ([SETUP], "ok") for m in ("70M", "160M", "410M", "1B", "1-4B", "2-8B")},
    **{f"pythia/{m}.yml": ([], "ok") for m in ("14M", "31M")},
    **{f"pythia/{m}.yml": ([SETUP], "ok") for m in ("6-9B", "12B")},
    **{f"llama/{m}.yml": ([LLAMA_TRAIN, SETUP], "ok") for m in ("7B", "13B", "30B", "65B")},
    **{f"llama2/{m}.yml": ([LLAMA_TRAIN, SETUP], "ok") for m in ("7B", "13B", "70B", "codellama_7B", "codellama_34B")},
    "mistral/7B.yml": ([LLAMA_TRAIN, SETUP], "ok"),
    "finetuning_configs/6-9B.yml": ([], "ok"),
    **{f"post-training/llama3-8b-{m}.yml": ([], "ok") for m in ("sft", "dpo", "kto", "rm")},
    "post-training/llama3-8b-reinforce.yml": ([], "ok"),
    "post-training/benchmarking/llama-13b-dpo.yml": ([], "ok"),
    "post-training/benchmarking/mistral-dpo.yml": ([], "ok"),
    "1-3B-transformer-engine.yml": (
        [SETUP],
        "not supported yet: te_layernorm_mlp=True, te_mha=True (Transformer Engine needs a CUDA GPU",
    ),
    "125M-dmoe.yml": ([SETUP], "ok"),
    "bnb_125M.yml": ([SETUP], "ok"),
    # GPT-NeoX's own typo: PyYAML reads `1.0e_8` as a string, on which the optimizer fails at the first step
    "gmlp_small.yml": ([SETUP], "optimizer.params.eps='1.0e_8' must be a finite number > 0"),
    "rwkv/170M.yml": ([SETUP], "ok"),
    **{f"mamba/mamba-{m}.yml": ([SETUP], "ok") for m in ("130M", "370M", "790M", "1.4B", "2.8B")},
    "llemma/7B.yml": ([], "unknown key 'decay_lr_to'"),
    "llemma/34B.yml": ([], "unknown key 'attention_type'"),
    "autotuning_configs/tune_1-3B.json": ([SETUP], "ok"),  # `autotuning` warned about: read under --autotuning only
    # ZeRO stages [0, 1, 2, 3] are the autotuner's search space: deepy.py --autotuning tune|run (docs/planner.md)
    "autotuning_configs/tune_6-7B.json": ([SETUP], "a list or 'all' is DeepSpeed autotuning's search space"),
    "autotuning_configs/small_tune.json": ([SETUP], "unknown key 'save-interval'"),
    "autotuning_configs/tune.json": ([SETUP], "unknown key 'autotuning_config'"),
}
# setup-style files, merged after 125M.yml
SETUP_FILES: dict[str, tuple[list[str], str]] = {
    SETUP: ([], "ok"),
    "local_setup_wandb.yml": ([], "ok"),
    "local_setup_comet.yml": ([], "ok"),
    "eleutherai_cluster.yml": ([], "ok"),
    "slurm_local.yml": ([], "ok"),
    "slurm_local.json": ([], "ok"),
    "prof.yml": ([SETUP], "key 'tensorboard_dir' is set in two files"),
    "text_generation.yml": ([SETUP], "ok"),
    "cpu_mock_config.yml": ([SETUP], "ok"),
    "docker/pythia-paths.yml": ([], "ok"),
    "sparse.yml": ([SETUP], "ok"),
}


def _world(paths: list[str]) -> int:
    """A world size the config's parallelism divides (GPT-NeoX reads it from the GPUs present)."""
    merged: dict = {}
    for p in paths:
        merged.update({k.replace("-", "_"): v for k, v in (yaml.safe_load(Path(p).read_text()) or {}).items()})
    return max(merged.get("pipe_parallel_size", 0), 1) * merged.get("model_parallel_size", 1)


def _kwargs(paths: list[str]) -> dict:
    from megatron.neox_arguments.loader import merge_config_files
    from megatron.neox_arguments.neox_args import KNOWN_KEYS

    merged = merge_config_files(paths, KNOWN_KEYS)
    values = dict(merged.values)
    values.setdefault("global_num_gpus", _world(paths))
    return {"values": values, "origins": merged.origins, "env": ENV}


needs_ref = pytest.mark.skipif(not os.path.isdir(REF), reason="GPT-NeoX reference configs not present")


@needs_ref
def test_every_reference_config_is_listed():
    found = {os.path.relpath(p, REF) for p in glob.glob(f"{REF}/**/*.y*ml", recursive=True)}
    found |= {os.path.relpath(p, REF) for p in glob.glob(f"{REF}/**/*.json", recursive=True)}
    assert found - set(EXPECTED) - set(SETUP_FILES) - {LLAMA_TRAIN} == set()


@needs_ref
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_config(name):
    extra, expected = EXPECTED[name]
    paths = [f"{REF}/{name}"] + [f"{REF}/{e}" for e in extra]
    _check(paths, expected)


@needs_ref
@pytest.mark.parametrize("name", sorted(SETUP_FILES))
def test_reference_setup_file(name):
    extra, expected = SETUP_FILES[name]
    paths = [f"{REF}/125M.yml"] + [f"{REF}/{e}" for e in extra] + [f"{REF}/{name}"]
    _check(paths, expected)


@needs_ref
def test_pythia_with_docker_paths_duplicate_spelling_is_detected():
    # GPT-NeoX silently lets `tokenizer-type` (second file) override `tokenizer_type`; we refuse it.
    with pytest.raises(ConfigError, match="'tokenizer_type' is set in two files"):
        NeoXArgs.from_ymls([f"{REF}/pythia/410M.yml", f"{REF}/docker/pythia-paths.yml"])


def _check(paths: list[str], expected: str) -> None:
    try:
        kwargs = _kwargs(paths)
    except ConfigError as e:
        outcome = str(e)
    else:
        try:
            NeoXArgs(**kwargs)
            outcome = "ok"
        except ConfigError as e:
            outcome = str(e)
    if expected == "ok":
        assert outcome == "ok", outcome
    elif expected.startswith("not supported"):
        assert expected in outcome and "\n" not in outcome, outcome  # one line naming the keys and the file
    else:
        assert expected in outcome, outcome


ADDITIONS = ("sparse.yml",)  # merged after a model config, as GPT-NeoX's configs/sparse.yml is
SHIPPED = sorted(
    os.path.relpath(p, REPO / "configs")
    for p in glob.glob(str(REPO / "configs/**/*.yml"), recursive=True)
    if "cpu/" not in p and not p.endswith(("local_setup.yml", "text_generation.yml", "train_config.yml", *ADDITIONS))
)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_loads(name):
    extra = ["llama/train_config.yml"] if name.split("/")[0] in ("llama", "llama2", "mistral") else []
    own = yaml.safe_load((REPO / "configs" / name).read_text())
    setup = [] if "vocab_file" in own else ["local_setup.yml"]
    paths = [str(REPO / "configs" / p) for p in [name, *extra, *setup, "text_generation.yml"]]
    args = NeoXArgs(**_kwargs(paths))
    assert args.num_layers > 0 and args.train_batch_size > 0


@pytest.mark.parametrize("name", ADDITIONS)
def test_shipped_additions_load_after_a_model_config(name):
    paths = [str(REPO / "configs" / p) for p in ["125M.yml", name, "local_setup.yml"]]
    args = NeoXArgs(**_kwargs(paths))
    assert args.attention_config == ["local", "global"] * 6 and args.sparsity_config == {
        "block": 16,
        "num_local_blocks": 32,
    }


def test_shipped_model_facts():
    load = lambda *p: NeoXArgs(**_kwargs([str(REPO / "configs" / x) for x in p]))  # noqa: E731
    neox20b = load("20B.yml")
    assert (neox20b.num_layers, neox20b.hidden_size, neox20b.num_attention_heads) == (44, 6144, 64)
    assert neox20b.gpt_j_residual and neox20b.rotary_pct == 0.25 and neox20b.gradient_accumulation_steps == 32
    p410 = load("pythia/410M.yml")
    assert (p410.num_layers, p410.hidden_size, p410.train_micro_batch_size_per_gpu) == (24, 1024, 32)
    mistral = load("mistral/7B.yml", "llama/train_config.yml")
    assert (mistral.num_kv_heads, mistral.seq_length, mistral.sliding_window_width) == (8, 8192, 4096)


def test_cpu_configs():
    tiny = NeoXArgs.from_ymls([str(REPO / "configs/cpu/tiny.yml")], {"global_num_gpus": 1})
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_attention_heads, tiny.seq_length) == (2, 64, 4, 64)
    assert tiny.precision == "fp32" and tiny.pos_emb == "rotary" and tiny.data_path is None and tiny.vocab_file is None
    two = NeoXArgs.from_ymls([str(REPO / "configs/cpu/tiny.yml"), str(REPO / "configs/cpu/local_setup.yml")])
    assert two.global_num_gpus == 2 and two.data_path == "data/stdlib/stdlib_text_document"
    quick = NeoXArgs.from_ymls([str(REPO / "configs/cpu/quickstart.yml")])
    assert quick.precision == "fp32" and quick.global_num_gpus == 2 and quick.gpt_j_residual
    assert quick.data_path == "data/stdlib/stdlib_text_document" and quick.vocab_file == "data/stdlib/tokenizer.json"
    assert quick.save == "runs/quickstart/checkpoints" and quick.tensorboard_dir == "runs/quickstart/tensorboard"


def test_docs_up_to_date():
    from megatron.neox_arguments import gen_docs

    current = gen_docs.DOC_PATH.read_text(encoding="utf-8")
    assert current == gen_docs.render(), "run: python -m megatron.neox_arguments.gen_docs"


def test_deepspeed_accepts_the_shipped_configs_deepspeed_config(monkeypatch):
    """DeepSpeed's own config parser (pydantic, extra keys forbidden) accepts every shipped config's DS dict."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    names = [*SHIPPED, "cpu/tiny.yml", "cpu/quickstart.yml"]
    one_rank = {"global_num_gpus": 1, "model_parallel_size": 1, "pipe_parallel_size": 0}
    for name in names:
        extra = ["llama/train_config.yml"] if name.split("/")[0] in ("llama", "llama2", "mistral") else []
        merged = _kwargs([str(REPO / "configs" / p) for p in [name, *extra]])
        merged["values"].update(one_rank)
        ds = NeoXArgs(**merged).deepspeed_config
        DeepSpeedConfig(ds)  # raises on unknown or malformed keys
