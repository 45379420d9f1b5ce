"""The post-training recipe of docs/post_training.md, run exactly as written: a Pythia-shaped Hugging Face model
(built from a config, no download) -> convert_hf_to_neox.py -> chat-template data -> SFT -> DPO through deepy.py ->
convert_neox_to_hf.py -> transformers -> lm-eval's hf backend on a shipped local task. The commands and the three
config files are read from the page, so the page cannot drift from what is tested."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.post_training_data import make_chat_tokenizer, pair_rows, sft_rows, write_jsonl

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "post_training.md"
SECTION = "## Recipe: a Hugging Face model through SFT and DPO"


def recipe() -> tuple[str, dict[str, str]]:
    """The section's bash block and its YAML blocks by file name (each YAML block starts with ``# <name>``)."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```(bash|yaml)\n(.*?)```", section, flags=re.S)
    bash = [body for kind, body in blocks if kind == "bash"]
    configs = {body.splitlines()[0].lstrip("# ").strip(): body for kind, body in blocks if kind == "yaml"}
    assert len(bash) == 1 and set(configs) == {"train.yml", "sft.yml", "dpo.yml"}
    return bash[0], configs


def build_hf_model(root: Path) -> Path:
    """A 2-layer Pythia-shaped GPTNeoXForCausalLM with a chat-template tokenizer, saved with save_pretrained."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(make_chat_tokenizer(root / "tokenizer_work")))
    config = transformers.GPTNeoXConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    out = root / "hf_model"
    transformers.GPTNeoXForCausalLM(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def preference_margin(model_dir: Path, tokenizer_dir: Path, rows: list[dict]) -> float:
    """Mean over pairs of log p(chosen) - log p(rejected) (assistant turn given the chat prompt), by transformers."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))  # the one with the chat template
    model = transformers.GPTNeoXForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()

    def logp(messages: list[dict]) -> float:
        def ids_of(text: str) -> list[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"])

        prompt = ids_of(tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True))
        whole = ids_of(tok.apply_chat_template(messages, tokenize=False))
        assert whole[: len(prompt)] == prompt
        ids = torch.tensor([whole])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        picked = logprobs.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        return float(picked[len(prompt) - 1 :].sum())

    return sum(logp(r["chosen"]) - logp(r["rejected"]) for r in rows) / len(rows)


def test_documented_recipe_runs_end_to_end(tmp_path: Path) -> None:
    bash, configs = recipe()
    hf_model = build_hf_model(tmp_path)
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(16))
    pairs = pair_rows(16)
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    for name, body in configs.items():
        (tmp_path / name).write_text(body, encoding="utf-8")
    env = {
        **os.environ,
        "NEOX": str(REPO),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "DS_ACCELERATOR": "cpu",
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", bash], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])

    # the exported weights are the DPO-trained ones: they prefer the chosen answers more than the original model
    assert (tmp_path / "checkpoints" / "sft" / "latest").exists()
    before, after = (
        preference_margin(hf_model, hf_model, pairs),
        preference_margin(tmp_path / "hf_dpo", hf_model, pairs),
    )
    assert after > before + 1.0, (before, after)
    results = list((tmp_path / "lm_eval_results").rglob("results_*.json"))
    assert len(results) == 1
    scores = json.loads(results[0].read_text())["results"]["forge_mc"]
    assert 0.0 <= scores["acc,none"] <= 1.0 and "acc_norm,none" in scores


@pytest.mark.parametrize("name", ["train.yml", "sft.yml", "dpo.yml"])
def test_recipe_configs_are_complete_yaml(name: str) -> None:
    import yaml

    assert isinstance(yaml.safe_load(recipe()[1][name]), dict)
