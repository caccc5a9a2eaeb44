"""Settings declared once: a frozen dataclass whose fields each carry a `Setting`.

A `Schema` is a frozen, keyword-only dataclass (torchtitan's JobConfig shape) whose fields say
in their metadata how a value is read and checked (`Setting.read`), what the command line calls
it (`Setting.flag`, default ``--`` + the field name) and its help text. From that one declaration
come the flags of a command (`autosearch.commands._schema.add_flags`), the keys of its
``--config`` file and of the Python keywords (`Schema.read`), and the messages: a value is
checked where it enters, and a wrong one is refused naming it in the words of that entry
(``--n-trials``, ``config 'x.yaml': n_trials`` or ``n_trials``).

`autosearch.TuneConfig` (one tuning job) and `autosearch.SweepConfig` (many) are schemas; the
readers below are shared by every schema and every command.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec

MAX_SEED = 2**32 - 1  # numpy's RandomState, which Optuna's samplers seed, takes 0 .. 2**32 - 1
# Dollars per device-hour: the dearest rented accelerator lists near $100 an hour; a thousand
# times that is a typo (or 1e308, which turns every cost into inf), not a price.
MAX_PRICE_PER_HOUR = 1e5


# ---- how one value is read and checked: each reader is (value, where) -> value ------------------
def read_single(value: Any, where: str) -> Any:
    if isinstance(value, (dict, list, tuple, set)):
        raise SpecError(f"{where} must be a single value, got a {type(value).__name__}")
    return value


def kind_of(value: Any) -> str:
    """How a message names what a value is: ``['h100-sxm'] (a list)`` (cut to one line)."""
    from autosearch.core._io import _short

    kind = type(value).__name__
    return f"{_short(value, 60)} ({'an' if kind[0] in 'aeiou' else 'a'} {kind})"


def read_path(value: Any, where: str, *, fix: str = "a name or the path of a file") -> str:
    """A name or a path (a text or an `os.PathLike`), never a list, number or None: the type
    is checked before any file is looked up, so the message names the field, not `os.fspath`."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise SpecError(f"{where} must be {fix}, got {kind_of(value)}")
    return value


def read_mapping(value: Any, where: str, *, fix: str = "a mapping of key: value") -> dict:
    """A mapping (a YAML block, a dict), as a dict; None is an empty one."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where} must be {fix}, got {kind_of(value)}")
    return dict(value)


def read_names(value: Any, where: str) -> tuple[str, ...]:
    """A list of non-empty texts (a profile's sources, the fields it measured); None: none."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise SpecError(f"{where} must be a list of texts, got {kind_of(value)}")
    return tuple(value)


def read_text(value: Any, where: str) -> str:
    value = read_single(value, where)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{where} must be a non-empty text, got {value!r}")
    return value.strip()


def read_text_file(value: Any, where: str) -> str:
    """The path of a text file the job reads (a CSV of measurements): it must be a regular file
    of UTF-8 text, checked here, before any work, so that a binary file is refused by name
    rather than deep in a parser (a missing file is left to the reader, which says what it
    wanted there)."""
    from autosearch.core._io import read_regular_file

    path = read_text(value, where)
    if not os.path.lexists(path):
        return path
    raw = read_regular_file(path, what=where, limit=64 << 20)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"{where} {path!r} is not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x}); "
            "give the CSV that calibrate wrote"
        ) from None
    return path


def read_integer(value: Any, where: str, low: int, high: int) -> int:
    value = read_single(value, where)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise SpecError(f"{where}: {value!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where} must be an integer, got {value!r}")
    if value < low:
        kind = "a positive integer (>= 1)" if low == 1 else f"an integer >= {low}"
        raise SpecError(f"{where} must be {kind}, got {value}")
    if value > high:
        raise SpecError(f"{where} = {value:,} is above the limit of {high:,}; check the number")
    return value


def read_count(value: Any, where: str) -> int:
    from autosearch.core._io import DEFAULT_INT_LIMIT

    return read_integer(value, where, 1, DEFAULT_INT_LIMIT)


def read_batch(value: Any, where: str) -> int:
    from autosearch.core._io import INT_LIMITS

    return read_integer(value, where, 1, INT_LIMITS["global_batch_size"])


def read_seed(value: Any, where: str) -> int:
    return read_integer(value, where, 0, MAX_SEED)


def read_price(value: Any, where: str) -> float:
    value = read_single(value, where)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise SpecError(f"{where}: {value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where} must be a number, got {value!r}")
    if not (math.isfinite(value) and 0 < value <= MAX_PRICE_PER_HOUR):
        raise SpecError(
            f"{where} must be a number of dollars per device-hour > 0 and at most "
            f"{MAX_PRICE_PER_HOUR:,.0f}, got {value!r} (e.g. 2.5)"
        )
    return float(value)


def read_positive(noun: str, example: str):
    """A finite number > 0 (seconds, GiB), from a number or its text."""

    def read(value: Any, where: str) -> float:
        value = read_single(value, where)
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise SpecError(f"{where}: {value!r} is not a number of {noun}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{where} must be a number of {noun}, got {value!r}")
        if not (math.isfinite(value) and value > 0):
            raise SpecError(
                f"{where} must be a number of {noun} > 0 (e.g. {example}), got {value}"
            )
        return float(value)

    return read


def read_seq_len(value: Any, where: str) -> int:
    from autosearch.core._io import INT_LIMITS

    return read_integer(value, where, 1, INT_LIMITS["seq_len"])


def read_seconds(value: Any, where: str) -> float:
    """A wall-clock budget in seconds (0: no limit)."""
    value = read_single(value, where)
    if isinstance(value, str):
        try:
            value = float(value.strip().removesuffix("s"))
        except ValueError:
            raise SpecError(f"{where}: {value!r} is not a number of seconds (e.g. 10)") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise SpecError(f"{where} must be a number of seconds >= 0 (0: no limit), got {value!r}")
    return float(value)


def read_margin(value: Any, where: str) -> float:
    """A fraction of device memory held back: 0.1, or ``10%``."""
    value = read_single(value, where)
    text = value.strip() if isinstance(value, str) else None
    if text is not None:
        try:
            value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise SpecError(
                f"{where}: {text!r} is not a fraction of device memory; give e.g. 0.1 or 10%"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where} must be a fraction of device memory (e.g. 0.1), got {value!r}")
    if not (math.isfinite(value) and 0 <= value < 0.9):
        raise SpecError(
            f"{where} must be a fraction of device memory from 0 to 0.9 (0.1 holds back 10%; 0 "
            f"fits up to the capacity), got {value!r}"
        )
    return float(value)


def read_lora_rank(value: Any, where: str) -> int:
    return read_integer(value, where, 1, 1 << 20)


def read_lora_targets(value: Any, where: str) -> str:
    """LoRA targets as one comma-separated text (``q,v`` or ``attention``), from a text or a
    list; each name is checked (`autosearch.core._lora.resolve_targets`)."""
    from autosearch.core._lora import resolve_targets

    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    text = read_text(value, where)
    problems: list[str] = []
    resolve_targets(text, gated=True, problems=problems)
    if problems:
        raise SpecError(f"{where}: " + "; ".join(problems))
    return ",".join(t.strip() for t in text.split(",") if t.strip())


def lora_of(rank: int | None, targets: str | None, *, where: str = "--lora-targets"):
    """The `ModelSpec.load` ``lora`` argument of ``--lora-rank`` / ``--lora-targets``: None
    without a rank (targets alone are refused: they need a rank)."""
    if rank is None:
        if targets is not None:
            raise SpecError(f"{where} {targets!r} needs a rank: add --lora-rank (e.g. 16)")
        return None
    return {"rank": rank, **({"targets": targets} if targets is not None else {})}


def read_switch(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where} must be true or false, got {value!r}")
    return value


def read_progress(value: Any, where: str) -> Any:
    """True / False, or a ``callable(done, total, best_tokens_per_s)`` (`autosearch.tune`)."""
    if isinstance(value, bool) or callable(value):
        return value
    raise SpecError(
        f"{where} must be True, False or a callable(done, total, best_tokens_per_s), got "
        f"{kind_of(value)}"
    )


def read_choice(noun: str, choices: tuple[str, ...], aliases: Mapping[str, str] | None = None):
    def read(value: Any, where: str) -> str:
        text = read_text(value, where)
        text = (aliases or {}).get(text, text)
        if text not in choices:
            raise SpecError(
                f"{where}: unknown {noun} {value!r}; choose one of {', '.join(choices)}"
            )
        return text

    return read


def read_model(value: Any, where: str) -> "ModelSpec | dict | str":
    from autosearch.core.model_spec import ModelSpec

    if isinstance(value, (ModelSpec, Mapping)):
        return value if isinstance(value, ModelSpec) else dict(value)
    return read_text(value, where)


def read_cluster(value: Any, where: str) -> "Cluster | dict | str":
    from autosearch.core.hardware import Cluster

    if isinstance(value, (Cluster, Mapping)):
        return value if isinstance(value, Cluster) else dict(value)
    return read_text(value, where)


def read_pins(value: Any, where: str) -> dict[str, Any]:
    """Pins as ``{dimension: value or [values]}``, from a mapping or from ``KEY=VALUE`` texts
    (``tp=8``, ``zero_stage=0,1``: the `--pin` form); a dimension pinned twice is refused."""
    from autosearch.core.strategy import ALIASES, _parse_scalar

    def values_of(text: str) -> Any:
        parts = [_parse_scalar(v.strip()) for v in text.split(",") if v.strip()]
        return parts[0] if len(parts) == 1 else parts

    if isinstance(value, Mapping):
        items = [(str(k), values_of(v) if isinstance(v, str) else v) for k, v in value.items()]
    else:
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, (list, tuple)):
            raise SpecError(f"{where} must be KEY=VALUE texts or a mapping, got {value!r}")
        items = []
        for text in texts:
            if not isinstance(text, str) or "=" not in text:
                raise SpecError(
                    f"{where} {text!r} is not KEY=VALUE (example: --pin tp=8 or "
                    "--pin zero_stage=0,1)"
                )
            key, rest = (x.strip() for x in text.split("=", 1))
            items.append((key, values_of(rest)))
    pins: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for given, v in items:
        key = ALIASES.get(given, given)  # Paddle's mp is tp: one dimension, one pin
        v = list(v) if isinstance(v, tuple) else v
        if key in pins:
            alias = "" if given == spelled[key] else f" (as {spelled[key]} and as {given})"
            raise SpecError(
                f"{where}: {key} is pinned twice{alias} ({pins[key]!r} and {v!r}); pin it "
                f"once, with every value it may take (e.g. --pin {key}=1,2)"
            )
        pins[key], spelled[key] = v, given
    return pins


# ---- the schema ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """The metadata of one schema field: what the CLI and the config file derive from it.

    Attributes:
        help: the flag's help text.
        read: ``(value, where) -> value``: reads a flag's text, a file's value or a Python value,
            and raises SpecError naming `where` when it is wrong.
        flag: the flag (default ``--`` + the field name with dashes).
        choices: the values a flag may take (listed in ``--help``).
        metavar: the flag's placeholder in ``--help``.
        repeat: the flag may be given several times (its values form a list).
        negate: the flag sets the field to False (``--no-recipes``).
        switch: the flag sets the field to True (``--fp8``).
        nargs: the flag takes several values at once (argparse's ``"+"``: ``--strategies a b``).
    """

    help: str
    read: Callable[[Any, str], Any]
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    repeat: bool = False
    negate: bool = False
    switch: bool = False
    nargs: str | None = None


def setting(default: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field whose metadata is a `Setting` (a dict default is a fresh dict each)."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"setting": Setting(**meta)})
    return field(default=default, metadata={"setting": Setting(**meta)})


def shared_setting(
    schema: "type[Schema]", name: str, *, default: Any = None, note: str = ""
) -> Any:
    """A field that is `schema`'s field `name` in another schema (``autosearch validate`` takes
    TuneConfig's model, cluster and runtime): the same reader, flag and help, written once; the
    help loses a "(required ...)" that holds only in `schema`, and gains `note`."""
    import re

    declared = {f.name: f for f in dataclasses.fields(schema)}[name].metadata["setting"]
    text = re.sub(r"\s*\(required[^)]*\)$", "", declared.help) + (f"; {note}" if note else "")
    return field(default=default, metadata={"setting": dataclasses.replace(declared, help=text)})


class Schema:
    """The base of a frozen, keyword-only dataclass of settings (`TuneConfig`, `SweepConfig`).

    The constructor checks every value given (a schema that exists is valid as far as its
    fields go); `read` checks a mapping of them as a file or the command line gives it;
    `from_dict` builds one from such a mapping; `replace` copies it with changes, checked.
    `RENAMED` maps an older key to ``(field, how its value is turned)`` for files written before.
    """

    RENAMED: ClassVar[Mapping[str, tuple[str, Callable[[Any], Any]]]] = {}
    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass, to the type checker

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default_factory is dict and not value:  # None or {}: an empty mapping
                object.__setattr__(self, f.name, {})
            elif value is not None and not (type(value) is type(f.default) and value == f.default):
                object.__setattr__(self, f.name, f.metadata["setting"].read(value, f.name))

    @classmethod
    def read(
        cls, data: Mapping[str, Any], *, what: str = "config", flags: bool = False
    ) -> dict[str, Any]:
        """The fields that `data` gives, each read and checked: ``{field name: value}``.

        Keys are the field names (``global_batch_size``, or ``global-batch-size``); one field
        given under two spellings is refused. Messages name a value ``<what>: <key>``, or by
        its flag when `flags` (the command line). None values are left out (not given).
        """
        by_key = {f.name: f for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name in cls.RENAMED:
                name, turn = cls.RENAMED[name]
                value = turn(value)
            f = by_key.get(name)
            if f is None:
                raise SpecError(f"{what}: unknown key {key!r}" + did_you_mean(str(key), by_key))
            if name in spelled:
                raise SpecError(
                    f"{what}: {spelled[name]!r} and {key!r} are one setting given twice; keep one"
                )
            spelled[name] = str(key)
            if value is None:
                continue
            where = flag_of(f) if flags else f"{what}: {key}"
            out[name] = f.metadata["setting"].read(value, where)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, what: str = "config") -> Any:
        """A schema from its dict form; a missing required key is refused naming it."""
        values = cls.read(data, what=what)
        missing = [f.name for f in dataclasses.fields(cls) if required(f) and f.name not in values]
        if missing:
            raise SpecError(f"{what}: missing key(s) {', '.join(missing)}; add them")
        return cls(**values)

    def replace(self, **changes: Any) -> Any:
        """A copy with `changes` (checked as the constructor checks)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """'; did you mean X?' for a near miss of one of `known`, else the list of them."""
    import difflib

    close = difflib.get_close_matches(key.replace("-", "_"), list(known), n=1, cutoff=0.75)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; valid keys: {', '.join(sorted(known))}"


def required(f: dataclasses.Field) -> bool:
    """The field has no default: a schema needs it."""
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a schema field."""
    return f.metadata["setting"].flag or "--" + f.name.replace("_", "-")
