"""Reading GPT-NeoX YAML/JSON config files and merging them, with errors that name the file and key."""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.parse_guards import json_int, json_object, json_tree_problems, yaml_graph_problem

# YAML 1.1 only reads `1.0e-5` as a float; GPT-NeoX users also write `1e-5`, `5e8`, `.5E3`.
_FLOAT_RE = re.compile(
    r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+|[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)$|^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+)$"
)


class _ConfigLoader(yaml.SafeLoader):
    """Safe loader that also reads exponent floats without a dot and refuses duplicate keys."""

    _root_node: yaml.Node | None = None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """Build a mapping, refusing a key written twice (top level: `-` and `_` spellings count as one)."""
        seen: dict[Any, int] = {}
        top_level = node is self._root_node
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            norm = normalize_key(key) if top_level and isinstance(key, str) else key
            if isinstance(norm, (list, dict, set)):  # YAML's complex keys (`? [a, b]`): not a name
                raise yaml.constructor.ConstructorError(
                    None, None, f"a {type(norm).__name__} cannot be a key; keys are names", key_node.start_mark
                )
            if norm in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first set on line {seen[norm]})", key_node.start_mark
                )
            seen[norm] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _load_yaml(text: str) -> Any:
    """Compose, check the node graph (``parse_guards``), then construct; ConfigError for a refused graph."""
    loader = _ConfigLoader(text)  # a SafeLoader
    try:
        loader._root_node = loader.get_single_node()
        if loader._root_node is None:
            return None
        problem = yaml_graph_problem(loader._root_node)
        if problem:
            raise ConfigError(problem)
        return loader.construct_document(loader._root_node)
    finally:
        loader.dispose()


def yaml_value(text: str) -> Any:
    """Parse a YAML scalar/flow value (command-line override) with the config files' number rules.

    Raises yaml.YAMLError for bad syntax, ConfigError for a value refused by ``parse_guards`` (an alias bomb, an
    integer too long to convert) or nested too deeply."""
    try:
        return _load_yaml(text)
    except RecursionError:
        raise ConfigError(f"nested more deeply than {sys.getrecursionlimit()} levels") from None


def normalize_key(key: str) -> str:
    """GPT-NeoX accepts `-` for `_` in top-level keys (`train-iters` is `train_iters`)."""
    return key.replace("-", "_")


def parse_config_text(text: str, path: str) -> dict:
    """Parse one config file's text (YAML, or JSON for ``.json``) into its top-level mapping."""
    if path.endswith(".json"):
        data = parse_json_text(text, path)
    else:
        try:
            data = _load_yaml(text)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested more deeply than {sys.getrecursionlimit()} levels") from None
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            what = " ".join(str(x) for x in (e.context, e.problem) if x)
            raise ConfigError(f"{path}: {where}invalid YAML: {what}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys to values, got {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{path}: keys must be strings, got {bad[0]!r}")
    return data


def parse_json_text(text: str, path: str) -> Any:
    """Parse JSON refusing what ``json.loads`` lets through: a key repeated in one object (the last would win), an
    integer too long to convert; at the top level `-` and `_` spellings of a key count as one (as in YAML)."""
    try:
        data = json.loads(text, parse_int=json_int, object_pairs_hook=json_object)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested more deeply than {sys.getrecursionlimit()} levels") from None
    problems = json_tree_problems(data)
    if isinstance(data, dict):
        seen: dict[str, str] = {}
        for key in data:
            norm = normalize_key(key)
            if norm in seen:
                problems.append(f"keys {seen[norm]!r} and {key!r} are the same key (- and _ are equal); keep one")
            seen.setdefault(norm, key)
    if problems:
        raise ConfigError([f"{path}: {p}" for p in problems])
    return data


@dataclass
class MergedConfig:
    """The union of several config files: values, where each key came from, and each file's raw text."""

    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)  # key -> "file.yml" or "the command line"
    spellings: dict[str, str] = field(default_factory=dict)  # key -> the spelling the user wrote
    config_files: dict[str, str] = field(default_factory=dict)  # basename -> raw text


def closest_keys(key: str, known: list[str] | set[str], n: int = 3) -> list[str]:
    """The valid keys closest to a misspelled one."""
    return difflib.get_close_matches(normalize_key(key), sorted(known), n=n, cutoff=0.6)


def unknown_key_message(key: str, where: str, known: set[str]) -> str:
    """'unknown key ...' with suggestions."""
    close = closest_keys(key, known)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "; see docs/neox_arguments.md"
    return f"unknown key {key!r} in {where}{hint}"


def merge_config_files(paths: list[str], known: set[str]) -> MergedConfig:
    """Load ``paths`` in order and merge their top-level keys (a key may be set in one file only)."""
    merged = MergedConfig()
    problems: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            problems.append(f"{path} is a directory, not a config file")
            continue
        if not os.path.isfile(path):
            problems.append(f"config file not found: {path}")
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"cannot read config file {path}: {e}")
            continue
        base = os.path.basename(path)
        if base in merged.config_files:
            problems.append(f"two config files are named {base!r}; they are stored by name, rename one: {path}")
            continue
        merged.config_files[base] = text
        try:
            data = parse_config_text(text, path)
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        for raw_key, value in data.items():
            key = normalize_key(raw_key)
            if key not in known:
                problems.append(unknown_key_message(raw_key, path, known))
                continue
            if key in merged.values:
                problems.append(
                    f"key {key!r} is set in two files: {merged.origins[key]} (as {merged.spellings[key]!r}) "
                    f"and {path} (as {raw_key!r}); set it in one file only"
                )
                continue
            merged.values[key] = value
            merged.origins[key] = path
            merged.spellings[key] = raw_key
    if problems:
        raise ConfigError(problems)
    return merged


def apply_overrides(merged: MergedConfig, overrides: dict[str, Any], known: set[str], where: str) -> None:
    """Apply values given outside the files (command line, caller); they win over the files."""
    problems = []
    for raw_key, value in overrides.items():
        key = normalize_key(raw_key)
        if key not in known:
            problems.append(unknown_key_message(raw_key, where, known))
            continue
        merged.values[key] = value
        merged.origins[key] = where
        merged.spellings[key] = raw_key
    if problems:
        raise ConfigError(problems)
