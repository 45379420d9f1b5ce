"""generate.py's greedy path is token-identical to transformers ``generate(do_sample=False)`` on the
convert_neox_to_hf export (batch 1 and a left-padded batch of prompts of different lengths), with the KV cache, with
``recompute: true`` and with the API's batched decoding; input-file mode without sample_output_file writes ``<sample_input_file>.output.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.neox_arguments import NeoXArgs, neox_namespace
from tests.e2e.eval_fixture import build_tiny_model

PROMPTS = ["The quick brown", "Q: What is 2 plus 2?\nA:", "To", "All the world's a stage, and"]


def _hf_greedy(export: Path, prompts: list[str], max_new: int) -> tuple[list[list[int]], list[list[int]]]:
    """(batch-1 continuations, batched left-padded continuations), cut before the first EOS."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    eos = tok.eos_token_id

    def cut(ids: list[int]) -> list[int]:
        return ids[: ids.index(eos)] if eos in ids else ids

    single = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            single.append(cut(out[0, ids["input_ids"].shape[1] :].tolist()))
        tok.padding_side = "left"
        tok.pad_token = tok.eos_token
        batch = tok(prompts, return_tensors="pt", padding=True)
        out = model.generate(**batch, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    batched = [cut(row[batch["input_ids"].shape[1] :].tolist()) for row in out]
    return single, batched


@pytest.mark.slow  # about 18 s on 2 busy cores
def test_greedy_generation_matches_transformers_generate(tmp_path: Path) -> None:
    from megatron.generation.text_generation import run_generation

    tiny = build_tiny_model(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"  {p.replace(chr(10), ' ')}  " for p in PROMPTS) + "\n\n")
    clean = [p.replace("\n", " ") for p in PROMPTS]
    single, batched = _hf_greedy(tiny.export, clean, 20)
    assert single == batched  # the reference itself is consistent
    assert sum(len(s) for s in single) > 20

    from megatron.tokenizer import TokenizerConfig, build_tokenizer

    tokenizer = build_tokenizer(TokenizerConfig.from_neox_args(NeoXArgs.from_ymls(tiny.configs)))
    for recompute in (False, True):
        overrides = {
            "text_gen_type": "input-file",
            "sample_input_file": str(prompts),
            "sample_output_file": None,
            "maximum_tokens": 20,
            "recompute": recompute,
        }
        args = NeoXArgs.from_ymls(tiny.configs, overwrite_values=overrides)
        records = run_generation(args)
        assert [r["context"] for r in records] == clean  # stripped
        for record, want in zip(records, single, strict=True):
            assert record["length"] == len(want) and record["text"] == (tokenizer.detokenize(want) if want else None)
        written = [json.loads(x) for x in Path(f"{prompts}.output.jsonl").read_text().splitlines()]
        assert [w["text"] for w in written] == [r["text"] for r in records]

    # the API decoding the 4 prompts of different lengths as one batch gives the same tokens
    from megatron.generation.api import generate_samples_from_prompt
    from megatron.generation.config import InferenceConfig
    from megatron.generation.sampling import SamplingConfig, kv_cache_forward
    from megatron.generation.text_generation import setup_for_inference

    model, _ = setup_for_inference(InferenceConfig.from_neox_args(NeoXArgs.from_ymls(tiny.configs)))
    cfg = SamplingConfig(maximum_tokens=20, seq_length=64)
    batched_records = generate_samples_from_prompt(kv_cache_forward(model), tokenizer, clean, cfg, batch_size=4)
    assert [r["length"] for r in batched_records] == [len(w) for w in single]
    assert [r["text"] for r in batched_records] == [tokenizer.detokenize(w) if w else None for w in single]


def test_precompute_writes_float32_logprobs(tmp_path: Path) -> None:
    """text_gen_type precompute: <data>_<name>.bin/.idx, one float32 document of seq_length log-probs per document,
    equal to the exported HF model's log-probs of the padded document."""
    import numpy as np
    import transformers

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, make_dataset
    from megatron.generation.text_generation import run_generation

    tiny = build_tiny_model(tmp_path)
    docs = [[5, 9, 30, 7, 2], list(range(1, 80)), [11]]
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "d_text_document.bin"), dtype=np.int32)
    for d in docs:
        builder.add_item(d)
        builder.end_document()
    builder.finalize(str(tmp_path / "d_text_document.idx"))
    prefix = str(tmp_path / "d_text_document")
    overrides = {"text_gen_type": "precompute", "train_data_paths": [prefix], "valid_data_paths": [prefix],
                 "test_data_paths": [prefix], "precompute_model_name": "ref", "seq_length": 32}  # fmt: skip
    records = run_generation(NeoXArgs.from_ymls(tiny.configs, overwrite_values=overrides))
    assert records[0] == {"precomputed": f"{prefix}_ref"}
    out = make_dataset(f"{prefix}_ref")
    assert len(out) == 3 and out.dtype == np.float32 and all(len(out[i]) == 32 for i in range(3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny.export), dtype=torch.float32).eval()
    for i, doc in enumerate(docs):
        ids = torch.tensor([(doc + [0] * 33)[:33]])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids[:, :-1]).logits, -1).gather(-1, ids[:, 1:, None])[0, :, 0]
        assert np.allclose(out[i], logp.numpy(), atol=1e-4), i


def test_precompute_output_is_atomic(tmp_path: Path) -> None:
    """An error while scoring leaves neither the output nor temporary files; a complete run writes both files and
    the next run keeps them (an existing .idx means a complete output)."""
    import numpy as np
    import pytest

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, make_dataset
    from megatron.generation.config import PrecomputeConfig
    from megatron.generation.precompute import precompute_logprobs

    prefix = str(tmp_path / "d_text_document")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in ([1, 2, 3], [4, 5], [6]):
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    args = neox_namespace(seq_length=4, train_micro_batch_size_per_gpu=1, precompute_model_name="m", load=None,
                          train_data_paths=[prefix], test_data_paths=None, valid_data_paths=None, data_impl="mmap")  # fmt: skip
    cfg = PrecomputeConfig.from_neox_args(args)
    calls: list[int] = []

    def failing(tokens: torch.Tensor) -> torch.Tensor:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("scoring failed")
        return torch.zeros(*tokens.shape, 8)

    with pytest.raises(RuntimeError, match="scoring failed"):
        precompute_logprobs(failing, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d_text_document.bin", "d_text_document.idx"]
    assert precompute_logprobs(lambda t: torch.zeros(*t.shape, 8), cfg) == [f"{prefix}_m"]
    out = make_dataset(f"{prefix}_m")
    assert len(out) == 3 and np.allclose(out[0], -np.log(8.0))  # uniform logits over 8 tokens
    assert not list(tmp_path.glob("*tmp*"))
    assert precompute_logprobs(failing, cfg) == [f"{prefix}_m"] and len(calls) == 2  # kept: not scored again
