"""Small helpers shared by every spec that is read from YAML: clear messages, no tracebacks."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import stat
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


# A name autosearch writes into scripts and configs (a model's, a hardware profile's): letters,
# digits and . _ + = - / (so no space, quote, newline or shell syntax), starting with a letter or
# digit. Checked where a name enters, so that no file autosearch writes can carry it as code.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=/-]{0,199}")

_FILE_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_name(value: Any, what: str) -> str:
    """`value` if it is a plain name (`NAME_RE`), else a SpecError naming `what`."""
    if isinstance(value, str) and NAME_RE.fullmatch(value):
        return value
    raise SpecError(
        f"{what} {_short(value)} is not allowed: a name is 1-200 letters, digits and . _ + = - /, "
        "starting with a letter or digit (it is written into scripts and configs); rename it"
    )


def name_from(text: str, fallback: str = "custom") -> str:
    """A plain name made of `text` (a file name, a path): other characters become ``-``."""
    name = re.sub(r"[^A-Za-z0-9._+=/-]+", "-", text).lstrip("._+=/-")[:200]
    return name or fallback


def file_kind(mode: int) -> str | None:
    """What a file that is not a regular file is (``a named pipe (FIFO)``), or None."""
    return next((kind for test, kind in _FILE_KINDS if test(mode)), None) or (
        None if stat.S_ISREG(mode) else "not a regular file"
    )


def read_regular_file(path: str, *, what: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the user's file `path`, at most `limit` of them.

    Only a regular file is read: a folder, a FIFO, a device or a socket is refused before it is
    opened for reading (a FIFO would block until a writer comes, a device may never end), and
    once more on the open descriptor, opened non-blocking, in case the path changed in between.

    Raises:
        SpecError: the file is missing, not a regular file, unreadable, or larger than `limit`.
    """
    if not path:
        raise SpecError(f"the {what} file name is empty; give the path of a file")
    try:
        kind = file_kind(os.stat(path).st_mode)
        if kind is None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as f:
                kind = file_kind(os.fstat(f.fileno()).st_mode)
                if kind is None:
                    os.set_blocking(f.fileno(), True)
                    raw = f.read(limit + 1)
    except FileNotFoundError:
        raise SpecError(f"{what} file {path!r} does not exist") from None
    except OSError as exc:
        raise SpecError(f"cannot read {what} file {path!r}: {exc.strerror}") from None
    if kind is not None:
        raise SpecError(f"{what} file {path!r} is {kind}; give the path of a regular file")
    if len(raw) > limit:
        raise SpecError(
            f"{what} file {path!r} is larger than {limit >> 20} MiB; a {what} file is a "
            "few lines of text: check that the path names the right file"
        )
    return raw


def read_yaml_mapping(source: str | os.PathLike, *, what: str) -> dict[str, Any]:
    """Read a YAML mapping from a file path, raising SpecError with the path and the fix.

    The file must be a regular file (`read_regular_file`) of UTF-8 text of at most
    `MAX_FILE_BYTES`; see `parse_yaml_mapping` for the limits on its content.
    """
    path = os.fspath(source)
    if not path:
        raise SpecError(f"the {what} file name is empty; give the path of a YAML file")
    raw = read_regular_file(path, what=what)
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
    The loader (`StrictLoader`) also refuses a key given twice in one mapping and integers that
    YAML 1.1 reads in another base than they look (``010`` is 8, ``1:30`` is 90).
    """
    if len(text) > MAX_FILE_BYTES:
        raise SpecError(f"{what} is larger than {MAX_FILE_BYTES >> 20} MiB")
    loader = None
    try:
        loader = StrictLoader(text)  # checks the characters first (ReaderError)
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
    except _Ambiguous as exc:
        raise SpecError(f"{what}: {exc}") from None
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


class _Ambiguous(Exception):
    """A YAML document that PyYAML reads, but not as its author meant."""


_PLAIN_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*|0x[0-9a-fA-F_]+)")


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing what it would silently read otherwise than written: a key
    given twice in one mapping (PyYAML keeps the last) and integers in YAML 1.1's other bases
    (``010`` is octal 8, ``0b11`` binary, ``1:30`` base 60: 90). Merge keys (``<<: *base``)
    may still be overridden, as YAML intends."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # PyYAML refuses it below
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _Ambiguous(
                    f"key {_short(key)} is given twice (lines {seen[key]} and {line}); "
                    "YAML would keep only the last value: give it once"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = str(node.value)
        if not _PLAIN_INT.fullmatch(text):
            raise _Ambiguous(
                f"{text!r} at line {node.start_mark.line + 1} is read by YAML as the integer "
                f"{super().construct_yaml_int(node)} (YAML 1.1 reads a leading 0 as octal, "
                "0b as binary, a:b as base 60); write the number in plain decimal digits, or "
                "quote it if text is meant"
            )
        return super().construct_yaml_int(node)


# (mappings reach construct_mapping through the inherited constructor; integers need this)
StrictLoader.add_constructor(
    "tag:yaml.org,2002:int",
    StrictLoader.construct_yaml_int,  # type: ignore[type-var]
)


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
