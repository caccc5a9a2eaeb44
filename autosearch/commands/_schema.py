"""A command's flags and ``--config`` file, derived from a schema (`autosearch.core.schema`).

As thin as Optuna's CLI: `add_flags` declares one flag per schema field from its `Setting`, and
`read_args` reads a command line back into checked values, a ``--config`` YAML file first and
the flags given over it (pins merge, a flag's pin replacing the file's for the same dimension).
Absent flags stay absent (argparse.SUPPRESS), so that a file's values are not overridden by
defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from autosearch.core.schema import Schema, did_you_mean, flag_of, read_switch


def add_flags(
    p: argparse.ArgumentParser, schema: "type[Schema]", *, only: Iterable[str] | None = None
) -> None:
    """One flag per field of `schema` (or of the fields named in `only`, in the schema's
    order), spelled, explained and typed by the field's `Setting`."""
    keep = None if only is None else set(only)
    for f in dataclasses.fields(schema):
        if keep is not None and f.name not in keep:
            continue
        s = f.metadata["setting"]
        kw: dict[str, Any] = dict(dest=f.name, help=s.help, default=argparse.SUPPRESS)
        if s.negate:
            kw.update(action="store_false")
        elif s.switch:
            kw.update(action="store_true")
        else:
            kw.update(action="append" if s.repeat else "store", metavar=s.metavar)
            kw.update(choices=s.choices, nargs=s.nargs)
        p.add_argument(flag_of(f), **kw)


def add_presentation_flags(p: argparse.ArgumentParser, flags: Mapping[str, str]) -> None:
    """Switches that present a run rather than define it (--quiet, --dry-run)."""
    for name, text in flags.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)


def read_args(
    args: argparse.Namespace,
    schemas: "Iterable[type[Schema]]",
    *,
    data: Mapping[str, Any] | None = None,
    what: str = "config",
    presentation: Iterable[str] = (),
) -> tuple[dict[str, Any], dict[str, bool]]:
    """The checked values of a command line: ``{field: value}`` over the fields of `schemas`
    (a command may take the fields of several: a sweep's own and a tuning job's; where two
    declare a field, the later one reads it), and the presentation switches given. `data` is
    the ``--config`` file's mapping, read first; a key that no schema knows is refused there,
    with a "did you mean" when it is close to one."""
    from autosearch.core.errors import SpecError

    owner = {f.name: schema for schema in schemas for f in dataclasses.fields(schema)}
    renamed = {k: v[0] for schema in schemas for k, v in schema.RENAMED.items()}
    shown = dict.fromkeys(presentation, False)
    values: dict[str, Any] = {}
    if data is not None:
        split: dict[type[Schema], dict[str, Any]] = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name in shown:
                shown[name] = read_switch(value, f"{what}: {key}")
                continue
            schema = owner.get(renamed.get(name, name))
            if schema is None:
                raise SpecError(f"{what}: unknown key {key!r}" + did_you_mean(str(key), owner))
            split.setdefault(schema, {})[key] = value
        for schema, given in split.items():
            values.update(schema.read(given, what=what))
    split = {}
    for name, schema in owner.items():
        if name in args:
            split.setdefault(schema, {})[name] = getattr(args, name)
    for schema, given in split.items():
        flags = schema.read(given, flags=True)
        if "pin" in flags and "pin" in values:
            flags["pin"] = {**values["pin"], **flags["pin"]}
        values.update(flags)
    shown.update({k: True for k in shown if getattr(args, k, False)})
    return values, shown
