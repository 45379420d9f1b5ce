"""Chat-formatted JSONL → token, label and reward streams (the engine of ``preprocess_data_with_chat_template.py``).

Each conversation (a list of ``{"role", "content"}`` messages under a ``--jsonl-keys`` key) is rendered once with
the HF tokenizer's chat template and tokenised once; every token belongs to the turn whose rendered text contains
its first character, found by rendering the conversation turn by turn (prefixes). Labels are the token id where
the model is trained and -100 elsewhere: tokens of ``--generation-role`` turns (all of them, or the last with
``--only-last``) after the turn's header (the text ``add_generation_prompt`` would add). ``--for-rm`` appends one
EOS token and trains only that token (reward models read their score there). ``--no-mask`` writes no label stream.
Rewards (``--reward-key``) are stored as float32, one value per token of the document (GPT-NeoX truncates them to
integers; we keep the float). Output goes to ``*.partial`` files renamed only when every line succeeded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.data.staged_output import staged_builders, worker_pool

IGNORE = -100


@dataclass
class ChatPreprocessConfig:
    """GPT-NeoX's ``preprocess_data_with_chat_template.py`` options."""

    inputs: list[str]
    output_prefix: str
    tokenizer_path: str
    jsonl_keys: list[str] = field(default_factory=lambda: ["messages"])
    generation_role: str = "assistant"
    only_last: bool = False
    no_mask: bool = False
    for_rm: bool = False
    reward_key: str | None = None
    binary_reward: bool = False
    num_docs: int | None = None
    workers: int = 1
    render_timeout: float = 10.0  # seconds one conversation may take to render and tokenise; 0 = no limit


@dataclass
class Encoded:
    """One conversation: tokens, labels (-100 = not trained)."""

    tokens: list[int]
    labels: list[int]


def load_chat_tokenizer(path: str) -> Any:
    """The HF tokenizer of a local folder; it must carry a chat template."""
    if not os.path.isdir(path):
        raise ValueError(f"--tokenizer-path {path}: not a directory (a local HF tokenizer folder is needed)")
    from megatron.tokenizer.tokenizer import auto_tokenizer

    try:
        tok = auto_tokenizer(path)  # trust_remote_code=False: the folder's own code never runs
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer-path {path}: cannot load an HF tokenizer ({str(e).splitlines()[0]})") from None
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"--tokenizer-path {path}: the tokenizer has no chat_template (tokenizer_config.json)")
    if tok.eos_token_id is None:
        raise ValueError(f"--tokenizer-path {path}: the tokenizer has no eos_token")
    return tok


class RenderTimeout(BaseException):
    """Raised inside a template render that ran past its time limit (a BaseException: libraries that catch
    ``Exception`` around the render must not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`RenderTimeout` in this block after ``seconds`` (wall clock) via ``SIGALRM``.

    Jinja renders in Python, so the alarm interrupts any template loop (transformers' sandbox bounds each ``range``
    but not nested loops). Only the main thread of a process can take signals: elsewhere (or with ``seconds <= 0``)
    the block runs unbounded. Preprocessing renders in the main thread of the tool or of its worker processes.
    """
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise RenderTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _render(tok: Any, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_conversation(tok: Any, messages: list[dict[str, Any]], cfg: ChatPreprocessConfig) -> Encoded:
    """Tokens and labels of one conversation (see the module docstring)."""
    full = _render(tok, messages)
    # Character spans [start, end) of each turn, and where a trained turn's content starts (after its header).
    spans: list[tuple[int, int, int | None]] = []
    start = 0
    trained = [i for i, m in enumerate(messages) if m["role"] == cfg.generation_role]
    if cfg.only_last:
        trained = trained[-1:]
    for i in range(len(messages)):
        end = len(_render(tok, messages[: i + 1])) if i < len(messages) - 1 else len(full)
        content_start = None
        if i in trained:
            header = _render(tok, messages[:i], generation_prompt=True) if i else ""
            content_start = len(header) if full.startswith(header) and len(header) >= start else start
        spans.append((start, end, content_start))
        start = end
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    tokens = [int(t) for t in enc["input_ids"]]
    labels = [IGNORE] * len(tokens)
    if not cfg.for_rm:
        for k, (char_start, _) in enumerate(enc["offset_mapping"]):
            for s, e, content_start in spans:
                if s <= char_start < e:
                    if content_start is not None and char_start >= content_start:
                        labels[k] = tokens[k]
                    break
    else:
        tokens.append(int(tok.eos_token_id))
        labels.append(int(tok.eos_token_id))
    return Encoded(tokens, labels)


def _messages(doc: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    if key not in doc:
        raise ValueError(f"{where}: no key {key!r} (keys: {', '.join(sorted(doc)) or 'none'})")
    msgs = doc[key]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: {key!r} must be a non-empty list of {{'role', 'content'}} messages")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: every message of {key!r} needs string 'role' and 'content', got {m!r}")
    return msgs


def _reward(doc: dict[str, Any], cfg: ChatPreprocessConfig, where: str) -> float:
    value = doc.get(cfg.reward_key)  # type: ignore[arg-type]
    if cfg.binary_reward and isinstance(value, bool):
        return 1.0 if value else -1.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: reward key {cfg.reward_key!r} must be a number, got {value!r}")
    if cfg.binary_reward:
        return 1.0 if value > 0 else -1.0
    return float(value)


def _read(cfg: ChatPreprocessConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    for path in cfg.inputs:
        if not os.path.isfile(path):
            raise ValueError(f"--input {path}: no such file")
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
                if not isinstance(doc, dict):
                    raise ValueError(f"{where}: each line must be a JSON object")
                yield where, doc


_TOK: Any = None
_CFG: ChatPreprocessConfig | None = None


def _init(cfg: ChatPreprocessConfig) -> None:
    global _TOK, _CFG
    _TOK, _CFG = load_chat_tokenizer(cfg.tokenizer_path), cfg


def _encode(item: tuple[str, dict[str, Any]]) -> tuple[dict[str, Encoded], float | None]:
    where, doc = item
    assert _CFG is not None
    out = {}
    for key in _CFG.jsonl_keys:
        msgs = _messages(doc, key, where)
        try:
            with time_limit(_CFG.render_timeout):
                out[key] = encode_conversation(_TOK, msgs, _CFG)
        except RenderTimeout:
            raise ValueError(
                f"{where}: the chat template took more than {_CFG.render_timeout:g} s to render {key!r} "
                "(a template with large loops?); stopped (raise the limit with --render-timeout, 0 = none)"
            ) from None
        except Exception as e:  # jinja errors of the template (e.g. roles it refuses)
            raise ValueError(f"{where}: the chat template failed on {key!r}: {e}") from None
    reward = _reward(doc, _CFG, where) if _CFG.reward_key else None
    return out, reward


def output_prefix(prefix: str, key: str, stream: str = "") -> str:
    """``{prefix}_{key}[_label|_reward]_document``."""
    return f"{prefix}_{key}{'_' + stream if stream else ''}_document"


def preprocess_chat(cfg: ChatPreprocessConfig) -> dict[str, Any]:
    """Write the streams; returns ``{"documents": n, "outputs": [prefixes]}``. Raises ValueError, leaving nothing."""
    if cfg.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {cfg.workers}")
    if cfg.render_timeout < 0:
        raise ValueError(f"--render-timeout must be >= 0 seconds (0 = no limit), got {cfg.render_timeout}")
    if cfg.binary_reward and not cfg.reward_key:
        raise ValueError("--binary-reward needs --reward-key")
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output-prefix: directory {out_dir} does not exist")
    _init(cfg)
    token_dtype = best_fitting_dtype(len(_TOK))
    streams: dict[str, tuple[str, Any]] = {}  # name -> (final prefix, dtype)
    for key in cfg.jsonl_keys:
        streams[f"{key}"] = (output_prefix(cfg.output_prefix, key), token_dtype)
        if not cfg.no_mask:
            streams[f"{key}:label"] = (output_prefix(cfg.output_prefix, key, "label"), np.int32)
        if cfg.reward_key:
            streams[f"{key}:reward"] = (output_prefix(cfg.output_prefix, key, "reward"), np.float32)
    prefixes = {name: prefix for name, (prefix, _) in streams.items()}
    count = 0
    with staged_builders(
        prefixes, lambda name, path: MMapIndexedDatasetBuilder(path, dtype=streams[name][1])
    ) as builders:
        items = _read(cfg)
        if cfg.num_docs is not None:
            items = (x for i, x in zip(range(cfg.num_docs), items))
        if cfg.workers == 1:
            results: Iterator[Any] = map(_encode, items)
            pool = None
        else:
            pool = worker_pool(cfg.workers, _init, (cfg,))
            results = pool.imap(_encode, items, chunksize=16)
        try:
            for per_key, reward in results:
                for key, enc in per_key.items():
                    builders[key].add_item(np.asarray(enc.tokens))
                    builders[key].end_document()
                    if f"{key}:label" in builders:
                        builders[f"{key}:label"].add_item(np.asarray(enc.labels))
                        builders[f"{key}:label"].end_document()
                    if reward is not None:
                        builders[f"{key}:reward"].add_item(np.full(len(enc.tokens), reward, dtype=np.float32))
                        builders[f"{key}:reward"].end_document()
                count += 1
        finally:
            if pool is not None:
                pool.terminate()
        if count == 0:
            raise ValueError(f"no documents in {', '.join(cfg.inputs)}; nothing written")
    return {"documents": count, "outputs": [p for p, _ in streams.values()]}
