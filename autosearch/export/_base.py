"""The interface every exporter implements (tests/test_export.py runs one contract suite on
all)."""

from __future__ import annotations

import abc
import dataclasses
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
    """

    runtime: str
    text: str
    mapped: frozenset[str]
    unsupported: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    command: str = ""
    filename: str = ""

    def render(self) -> str:
        """The text followed by the caveats, as comment lines."""
        lines = [self.text.rstrip()]
        comment = "//" if self.text.lstrip().startswith("{") else "#"
        if self.unsupported:
            lines.append("")
            lines.append(f"{comment} no equivalent in {self.runtime}:")
            lines += [f"{comment}   {field}: {why}" for field, why in self.unsupported]
        if self.command:
            lines.append("")
            lines += [f"{comment} launch:"] + [
                f"{comment}   {x}" for x in self.command.splitlines()
            ]
        if self.notes:
            lines.append("")
            lines += [f"{comment} note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


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


def strategy_fields() -> tuple[str, ...]:
    from autosearch.core.strategy import Strategy

    return tuple(f.name for f in dataclasses.fields(Strategy))
