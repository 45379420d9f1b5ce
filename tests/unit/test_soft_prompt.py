"""Soft prompt tuning in the model: the prefix (GPT-NeoX's tensor name, init from init_string or uniform), the rest
frozen, logits per token, masks and incremental decoding; bad settings refused."""

from __future__ import annotations

import pytest
import torch

from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.kv_cache import KVCache
from megatron.neox_arguments import ConfigError
from tests.unit.test_neox_args import build

V = 64
SOFT = {"enabled": True, "n_tokens": 3, "init_range": 0.25}


def cfg(**kw) -> GPTModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=V,
        max_position_embeddings=16,
        pos_emb="rotary",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        soft_prompt_tuning=SOFT,
    )
    return GPTModelConfig(**{**base, **kw})


def test_only_the_prefix_trains_and_it_is_spec_one_under_gpt_neox_name() -> None:
    model = build_sequential_model(cfg())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["sequential.1.soft_embedding_weight"]
    weight = model.sequential[1].soft_embedding_weight
    assert weight.shape == (3, 32)
    assert weight.abs().max() <= 0.25 and weight.std() > 0.05  # uniform in [-init_range, init_range]
    # every other layer keeps its index: the unprompted model's state dict plus the prefix
    plain = build_sequential_model(cfg(soft_prompt_tuning=None))
    assert set(model.state_dict()) == set(plain.state_dict()) | {"sequential.1.soft_embedding_weight"}
    model(torch.randint(0, V, (2, 8))).float().sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if p is not weight)


@pytest.mark.parametrize(("ids", "rows"), [((5, 7), [5, 7, 5]), ((1, 2, 3, 4), [1, 2, 3])])
def test_init_string_tokens_give_the_prefix_cut_or_repeated(ids: tuple[int, ...], rows: list[int]) -> None:
    model = build_sequential_model(cfg(soft_prompt_init_ids=ids))
    table = model.sequential[0].word_embeddings.weight
    assert torch.equal(model.sequential[1].soft_embedding_weight, table[rows])


def test_tokens_see_the_prefix_and_logits_stay_per_token() -> None:
    torch.manual_seed(0)
    model = build_sequential_model(cfg()).eval()
    plain = build_sequential_model(cfg(soft_prompt_tuning=None)).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    tokens = torch.randint(0, V, (2, 10))  # s + n_tokens = 13 > max_position_embeddings is fine with rotary
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (2, 10, V)
        # the prefix is what changes the outputs
        assert not torch.allclose(logits, plain(tokens), atol=1e-3)
        model.sequential[1].soft_embedding_weight.zero_()
        zeros = model(tokens)
        assert not torch.allclose(zeros, logits, atol=1e-3)
        # an explicit causal mask is extended over the prefix like the implicit one
        mask = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1)[None, None]
        model.train()
        torch.testing.assert_close(model(tokens, attention_mask=mask), zeros, rtol=1e-5, atol=1e-5)


def test_incremental_decoding_keeps_the_prefix_in_the_cache() -> None:
    model = build_sequential_model(cfg()).eval()
    tokens = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        first = model(tokens[:, :5], kv_cache=cache)
        steps = [model(tokens[:, i : i + 1], kv_cache=cache) for i in range(5, 9)]
    torch.testing.assert_close(first, full[:, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 5:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"enabled": True, "n_tokens": 0}, "n_tokens=0 must be an integer >= 1"),
        ({"enabled": True, "num_tokens": 4}, "reads n_tokens, not num_tokens"),
        ({"enabled": True, "init_range": -1}, "init_range=-1 must be a finite number > 0"),
        ({"enabled": "yes"}, "enabled must be true or false"),
    ],
)
def test_bad_settings_name_the_key(value: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=f"soft_prompt_tuning=.*{message}"):
        build(soft_prompt_tuning=value)


def test_pipeline_engine_is_accepted() -> None:
    """The pipeline engine runs soft prompts (trained in tests/e2e/test_train_sharing_soft_prompt.py)."""
    args = build(soft_prompt_tuning=SOFT, pipe_parallel_size=1)
    assert args.pipe_parallel_size == 1 and args.soft_prompt_tuning["n_tokens"] == 3


def test_the_optimizer_sees_only_the_prefix() -> None:
    from megatron.training.optimizers import weight_decay_param_groups

    model = build_sequential_model(cfg())
    groups = weight_decay_param_groups(model, 0.01)
    params = [p for g in groups for p in g["params"]]
    assert len(params) == 1 and params[0] is model.sequential[1].soft_embedding_weight
