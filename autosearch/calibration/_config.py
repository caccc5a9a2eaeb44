"""`CalibrateConfig`: every setting of ``autosearch calibrate``, declared once.

Each field carries its `Setting` (help text, flag, reader), from which the command's flags and
its ``--config`` file keys are derived (`autosearch.commands._schema`); the field names are
`calibrate`'s keywords, so the command calls ``calibrate(**config.to_kwargs())``. Torch-free.

Example:
    >>> from autosearch.calibration._config import CalibrateConfig
    >>> CalibrateConfig(out="cpu.yaml", world_sizes="1,2").world_sizes
    (1, 2)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autosearch.core.errors import SpecError
from autosearch.core.schema import (
    Schema,
    read_choice,
    read_switch,
    read_text,
    read_text_file,
    setting,
)

DEVICES = ("auto", "cuda", "cpu")
STATISTICS = ("median", "min")


def read_world_sizes(value: Any, where: str) -> tuple[int, ...]:
    """Process counts as ``1,2`` (a text), one integer, or a list of integers; each >= 1 (the
    bound of processes per core is `calibrate`'s, which knows the machine)."""
    items = value.split(",") if isinstance(value, str) else value
    items = [items] if isinstance(items, int) else items
    try:
        sizes = tuple(int(x.strip()) if isinstance(x, str) else x for x in items if str(x).strip())
    except (TypeError, ValueError):
        raise SpecError(
            f"{where}: {value!r} is not a comma-separated list of integers (example: 1,2)"
        ) from None
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise SpecError(f"{where}: world sizes must be integers >= 1, got {value!r}")
    return sizes


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig(Schema):
    """Every setting of one calibration: what to measure, how to fit it, and where the profile
    goes. A frozen record; `to_kwargs` gives `calibrate`'s keywords."""

    device: str = setting(
        "auto",
        read=read_choice("device", DEVICES),
        choices=DEVICES,
        help="device to measure (default: cuda if torch sees one, else cpu)",
    )
    world_sizes: tuple[int, ...] | None = setting(
        None,
        read=read_world_sizes,
        metavar="N,N,...",
        help="process counts to measure, e.g. 1,2 (collectives need 2 or more; "
        "default 1,2 on CPU, 1 and the GPU count on GPU)",
    )
    quick: bool = setting(
        False,
        read=read_switch,
        switch=True,
        help="small grids and messages (seconds instead of minutes)",
    )
    statistic: str = setting(
        "median",
        read=read_choice("statistic", STATISTICS),
        choices=STATISTICS,
        help="statistic of the timed calls of each point (default median)",
    )
    name: str | None = setting(
        None, read=read_text, help="profile name (default: the --out file name)"
    )
    from_csv: str | None = setting(
        None,
        read=read_text_file,
        metavar="CSV",
        help="fit the measurements of an earlier calibration instead of "
        "measuring again (the profile YAML written with it must sit next to it)",
    )
    accept_untrusted: bool = setting(
        False,
        read=read_switch,
        switch=True,
        help="write a profile that failed its quality checks under the --out name and exit 0 "
        "(the problems stay in the profile; by default it is written as <out>.untrusted.yaml "
        "and the command exits with status 3)",
    )
    force: bool = setting(
        False,
        read=read_switch,
        switch=True,
        help="on CPU, run world sizes of more than 4 processes per core (refused by default)",
    )
    out: str = setting(
        read=read_text,
        help="profile YAML to write, e.g. results/calibration/cpu-local.yaml (this machine's, "
        "which Engine.tune uses; required, here or in --config)",
    )

    def to_kwargs(self) -> dict[str, Any]:
        """`calibrate`'s keywords."""
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.world_sizes is not None:
            kwargs["world_sizes"] = list(self.world_sizes)
        return kwargs
