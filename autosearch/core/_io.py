"""Small helpers shared by every spec that is read from YAML: clear messages, no tracebacks."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import yaml

from autosearch.core.errors import SpecError

# Limits on what a user's YAML may hold (hostile input). The largest file autosearch
# ships or writes is ~10 KiB (a calibrated profile); these leave two orders of magnitude of room
# and stop a file that would hang or exhaust memory before anything reads it.
MAX_FILE_BYTES = 1 << 20  # 1 MiB
MAX_NODES = 100_000  # scalars + collections after expanding aliases ("billion laughs")
MAX_DEPTH = 64  # nesting of mappings and lists
MAX_ABS_INT = 1 << 63  # a number that does not fit a 64-bit integer is a typo or an attack

# Upper limits on integer fields, by field name (positive_int looks the name up; a name given as
# "what: field" uses its last part). Each is far above any machine or model built so far and low
# enough that the cost model and the search stay bounded in time and memory.
INT_LIMITS = {
    "n_layers": 1 << 16,
    "hidden_size": 1 << 20,
    "n_heads": 1 << 16,
    "n_kv_heads": 1 << 16,
    "ffn_hidden_size": 1 << 22,
    "vocab_size": 1 << 24,
    "seq_len": 1 << 24,
    "dp": 1 << 20,
    "tp": 1 << 16,
    "pp": 1 << 16,
    "virtual_stages": 1 << 10,
    "micro_batch_size": 1 << 24,
    "global_batch_size": 1 << 24,
    "n_nodes": 1 << 20,
    "gpus_per_node": 1 << 12,
}
DEFAULT_INT_LIMIT = 1 << 40
MAX_DEVICES = 1 << 20  # devices in one cluster: 1,048,576


def read_yaml_mapping(source: str | os.PathLike, *, what: str) -> dict[str, Any]:
    """Read a YAML mapping from a file path, raising SpecError with the path and the fix.

    The file must be UTF-8 text of at most `MAX_FILE_BYTES`; see `parse_yaml_mapping` for the
    limits on its content.
    """
    path = os.fspath(source)
    if not path:
        raise SpecError(f"the {what} file name is empty; give the path of a YAML file")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(f"{what} file {path!r} does not exist") from None
    except IsADirectoryError:
        raise SpecError(
            f"{what} file {path!r} is a folder; give the path of a YAML file"
        ) from None
    except OSError as exc:
        raise SpecError(f"cannot read {what} file {path!r}: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise SpecError(
            f"{what} file {path!r} is larger than {MAX_FILE_BYTES >> 20} MiB; a {what} file is a "
            "few lines of YAML: check that the path names the right file"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"{what} file {path!r} is not UTF-8 text "
            f"(byte {exc.start} is 0x{raw[exc.start]:02x}); give a YAML text file"
        ) from None
    return parse_yaml_mapping(text, what=f"{what} file {path!r}")


def parse_yaml_mapping(text: str, *, what: str) -> dict[str, Any]:
    """Parse YAML text that must be one mapping, within the limits above.

    Raises SpecError (never a YAML traceback) for invalid YAML, a file over `MAX_NODES` nodes once
    aliases are expanded or nested deeper than `MAX_DEPTH`, NaN or infinite numbers, integers
    beyond 64 bits, and a document that is not a mapping. An empty document is an empty mapping.
    """
    if len(text) > MAX_FILE_BYTES:
        raise SpecError(f"{what} is larger than {MAX_FILE_BYTES >> 20} MiB")
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # checks the characters first (ReaderError)
        node = loader.get_single_node()
        if node is not None:
            _check_node_size(node, what)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{what} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise SpecError(f"{what} is nested too deeply (more than {MAX_DEPTH} levels)") from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(
            f"{what} must be a YAML mapping of key: value, got a {type(data).__name__}"
        )
    _check_numbers(data, what, "")
    return data


def _check_node_size(root: yaml.Node, what: str) -> None:
    """Refuse a document whose expanded size (aliases counted each time they are used) exceeds
    MAX_NODES or whose nesting exceeds MAX_DEPTH. Linear in the composed graph: each shared node's
    size is computed once (PyYAML composes an alias as a second reference to the same node)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise SpecError(f"{what} is nested too deeply (more than {MAX_DEPTH} levels)")
        known = sizes.get(id(node))
        if known is not None:
            return known
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [x for pair in node.value for x in pair]
        else:
            children = []
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_NODES:
                raise SpecError(
                    f"{what} holds more than {MAX_NODES:,} values once its aliases (*name) are "
                    "expanded; write the values out, without anchors and aliases"
                )
        sizes[id(node)] = total
        return total

    size(root, 0)


def _check_numbers(value: Any, what: str, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(f"{what}: {where or 'the value'} is {value}; give a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_ABS_INT:
        raise SpecError(f"{what}: {where or 'the value'} = {value} does not fit in 64 bits")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_numbers(key, what, f"{where}.{key}" if where else f"key {key!r}")
            _check_numbers(item, what, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_numbers(item, what, f"{where}[{i}]")


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
            f"{what}: unknown key(s) {', '.join(map(_short, unknown))}; "
            f"valid keys are {', '.join(sorted(names))}"
        )
    return out


@functools.lru_cache(maxsize=256)
def _int_limit(name: str) -> int:
    return INT_LIMITS.get(name.rsplit(": ", 1)[-1], DEFAULT_INT_LIMIT)


def positive_int(value: Any, name: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Check an integer field (bools and floats with a fraction are rejected).

    `maximum` defaults to `INT_LIMITS[field]` (the field is `name`, or the part after the last
    ": "), else `DEFAULT_INT_LIMIT`.
    """
    if maximum is None:
        maximum = _int_limit(name)
    if type(value) is int and minimum <= value <= maximum:  # the common case, fast
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise SpecError(f"{name} must be an integer >= {minimum}, got {_short(value)}")
    if value < minimum:
        raise SpecError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise SpecError(
            f"{name} = {int(value):,} is above the limit of {maximum:,}; "
            "check the number (a typo, or the wrong field)"
        )
    return int(value)


def positive_float(value: Any, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{name} must be a number, got {_short(value)}")
    if not math.isfinite(value):
        raise SpecError(f"{name} must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise SpecError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


def _short(value: Any, limit: int = 80) -> str:
    """repr() of a value a user gave, cut to `limit` characters (a message must stay one line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...)"
