"""Checking (and lightly coercing) config values against the annotated field types."""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

import yaml

from megatron.neox_arguments.loader import yaml_value
from megatron.neox_arguments.parse_guards import max_int_digits

# PyYAML (YAML 1.1) loads `1e-4` or `5e8` as strings; they are accepted as numbers.
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


class _Mismatch(Exception):
    """The value does not fit this type."""


def describe(tp: Any) -> str:
    """Human-readable name of an annotation, e.g. ``int or null`` or ``one of 'a', 'b'``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _coerce_number(value: Any, want: type) -> Any:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        if len(value.strip()) > max_int_digits():  # int() would raise; such a number is never a valid value
            raise _Mismatch
        value = float(value) if want is float or not value.strip().lstrip("+-").isdigit() else int(value)
    if want is float and isinstance(value, (int, float)):
        return float(value)
    if want is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    raise _Mismatch


def _coerce(value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if value == choice and type(value) is type(choice):
                return choice
            if isinstance(value, str) and isinstance(choice, str) and value.lower() == choice.lower():
                return choice
        raise _Mismatch
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(tp)
        if value is None and type(None) in members:
            return None
        # Exact type matches first, so that `int | float` keeps an int and `str | list` keeps a str.
        for member in members:
            if isinstance(member, type) and type(value) is member:
                return value
        for member in members:
            try:
                return _coerce(value, member)
            except _Mismatch:
                continue
        raise _Mismatch
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if tp in (int, float):
        return _coerce_number(value, tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise _Mismatch
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _Mismatch


def coerce_value(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return ``(ok, value)``: ``value`` converted to fit ``tp``, or ``ok`` False.

    ``None`` (YAML ``null``) fits only keys whose type allows it (``int | None``...).
    """
    try:
        return True, _coerce(value, tp)
    except _Mismatch:
        return False, value


def parse_cli_value(text: str, tp: Any) -> Any:
    """Interpret a command-line string for a key of type ``tp`` (YAML syntax, but strings stay strings)."""
    if _accepts_str(tp):
        try:
            parsed = yaml_value(text)
        except yaml.YAMLError:
            return text
        # Keep the raw text for string keys unless it parses to another type the key accepts.
        ok, coerced = coerce_value(parsed, tp)
        if ok and not isinstance(coerced, str) and parsed is not None:
            return coerced
        return text
    try:
        return yaml_value(text)
    except yaml.YAMLError:
        return text


def _accepts_str(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is str:
        return True
    if origin is Literal:
        return any(isinstance(c, str) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_str(a) for a in typing.get_args(tp))
    return False
