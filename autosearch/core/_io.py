"""Small helpers shared by every spec that is read from YAML: clear messages, no tracebacks."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from autosearch.core.errors import SpecError


def read_yaml_mapping(source: str | os.PathLike, *, what: str) -> dict[str, Any]:
    """Read a YAML mapping from a file path, raising SpecError with the path and the fix."""
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SpecError(f"{what} file {path!r} does not exist") from None
    except OSError as exc:
        raise SpecError(f"cannot read {what} file {path!r}: {exc.strerror}") from None
    return parse_yaml_mapping(text, what=f"{what} file {path!r}")


def parse_yaml_mapping(text: str, *, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{what} is not valid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(
            f"{what} must be a YAML mapping of key: value, got a {type(data).__name__}"
        )
    return data


def check_keys(
    data: dict[str, Any], cls: type, *, what: str, aliases: dict[str, str] | None = None
) -> dict[str, Any]:
    """Map aliases to field names and reject unknown keys, naming the ones that exist."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    out: dict[str, Any] = {}
    unknown = []
    for key, value in data.items():
        key = (aliases or {}).get(key, key)
        if key in names:
            if key in out:
                raise SpecError(f"{what}: {key!r} is given twice (once through an alias)")
            out[key] = value
        else:
            unknown.append(str(key))
    if unknown:
        raise SpecError(
            f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys are"
            f" {', '.join(sorted(names))}"
        )
    return out


def positive_int(value: Any, name: str, *, minimum: int = 1) -> int:
    """Check an integer field (bools and floats with a fraction are rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise SpecError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise SpecError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def positive_float(value: Any, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise SpecError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)
