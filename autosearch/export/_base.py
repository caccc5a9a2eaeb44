"""The interface every exporter implements (tests/test_export.py runs one contract suite on
all)."""

from __future__ import annotations

import abc
import dataclasses
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy


@dataclass(frozen=True)
class Exported:
    """A strategy in another runtime's words.

    Attributes:
        runtime: the runtime's name.
        text: flags, JSON or TOML, ready to paste.
        mapped: Strategy fields that the text expresses.
        unsupported: (field, why) for each field the runtime cannot express as chosen; the text
            then holds the closest setting, and `why` says what differs.
        notes: other remarks (how the runtime derives a value, launch hints).
        command: the command that launches training with `text` (empty when the text is the
            command itself, as Megatron-LM's arguments are).
        filename: the file name `text` is written to next to best_strategy.yaml.
        model_fields: (field, setting) for each model field (`MODEL_FIELDS`) the text gives the
            framework: its flag, key or model argument and value.
        refused: (field, why) for each model field the framework has no setting for: the
            export builds another model there (`export` refuses it unless asked to go on).
        script: the launch script (bash): rendezvous, placeholders, the mock-data switch.
        files: other files the script needs, (file name, text).
    """

    runtime: str
    text: str
    mapped: frozenset[str]
    unsupported: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    command: str = ""
    filename: str = ""
    model_fields: tuple[tuple[str, str], ...] = ()
    refused: tuple[tuple[str, str], ...] = ()
    script: str = ""
    files: tuple[tuple[str, str], ...] = ()

    def render(self, *, comment: str | None = None) -> str:
        """The text followed by the caveats, as comment lines (``#``, or ``//`` after JSON)."""
        lines = [self.text.rstrip()]
        if comment is None:
            comment = "//" if self.text.lstrip().startswith("{") else "#"
        return "\n".join(lines + self.caveats(comment=comment)) + "\n"

    def caveats(self, *, comment: str = "#") -> list[str]:
        """What `text` cannot say, as comment lines: each note is made one line
        (`one_line`), so no text can end a comment and start a line of code."""
        lines = []
        if self.refused:
            lines += [
                "",
                f"{comment} WARNING: {self.runtime} builds another model: no setting for",
            ]
            lines += [f"{comment}   {one_line(f'{field}: {why}')}" for field, why in self.refused]
        if self.unsupported:
            lines += ["", f"{comment} no equivalent in {self.runtime}:"]
            lines += [
                f"{comment}   {one_line(f'{field}: {why}')}" for field, why in self.unsupported
            ]
        if self.command:
            lines += ["", f"{comment} launch:"]
            lines += [f"{comment}   {one_line(x)}" for x in self.command.splitlines()]
        if self.notes:
            lines.append("")
            lines += [f"{comment} note: {one_line(n)}" for n in self.notes]
        return lines


class Exporter(abc.ABC):
    """Translates a Strategy into the configuration of a training runtime."""

    name: str

    @abc.abstractmethod
    def export(
        self,
        strategy: "Strategy",
        *,
        model: "ModelSpec | None" = None,
        cluster: "Cluster | None" = None,
    ) -> Exported:
        """The runtime's configuration for `strategy`; `model` adds the model's shape, `cluster`
        the launch command (nodes and devices per node)."""


class FieldMap:
    """What an exporter does with each model field: the framework setting it writes, or why
    there is none."""

    def __init__(self) -> None:
        self.exported: dict[str, str] = {}
        self.refused: dict[str, str] = {}

    def set(self, fields: "str | Iterable[str]", setting: str) -> None:
        for f in (fields,) if isinstance(fields, str) else fields:
            self.exported[f] = setting

    def refuse(self, field: str, why: str) -> None:
        self.refused[field] = why
        self.exported.pop(field, None)


def refusal(runtime: str, model_name: str, refused: Iterable[tuple[str, str]]) -> str:
    """The message of the SpecError an export raises for fields `runtime` cannot build."""
    lines = "; ".join(f"{field} ({why})" for field, why in refused)
    return (
        f"{runtime} cannot build {model_name} as planned: no setting for {lines}. Export "
        "anyway with allow_unsupported=True (autosearch export --allow-unsupported), and the "
        "files say what differs; or plan a model without these features"
    )


def one_line(text: object) -> str:
    """`text` on one line of printable characters: every line break (``\\n``, ``\\r``, and the
    Unicode ones ``str.splitlines`` knows, U+2028 included) and control character becomes a space,
    so that a comment stays a comment in any file."""
    printable = "".join(c if c.isprintable() else " " for c in str(text))
    return " ".join(printable.split())


def shell_words(words: Iterable[object]) -> str:
    """One shell command line of `words`, each quoted for POSIX sh (`shlex.quote`) when needed."""
    return " ".join(shlex.quote(str(w)) for w in words)


def declared_mappings(
    runtime: str, strategy: "Strategy"
) -> tuple[dict[str, object], set[str], list[tuple[str, str]]]:
    """What the dimension registry declares for `runtime` (`Dimension.exports` and `no_export`):
    {key: value} for each declared dimension whose value is not its default, the dimensions it
    so maps, and (field, why) for those the runtime cannot express as chosen."""
    from autosearch.core import dimensions

    keys: dict[str, object] = {}
    mapped: set[str] = set()
    unsupported: list[tuple[str, str]] = []
    for d in dimensions.DIMENSIONS:
        if runtime not in d.exports and runtime not in d.no_export:
            continue
        value = getattr(strategy, d.name)
        if value == d.default:
            mapped.add(d.name)
        elif runtime in d.exports:
            keys[d.exports[runtime]] = value
            mapped.add(d.name)
        else:
            unsupported.append((d.name, d.no_export[runtime]))
    return keys, mapped, unsupported


def strategy_fields() -> tuple[str, ...]:
    from autosearch.core.strategy import Strategy

    return tuple(f.name for f in dataclasses.fields(Strategy))
