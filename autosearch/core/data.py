"""The data files the cost model ships in `cost_models/` (runtime presets, hardware profiles,
error and memory bands), found without importing `cost_models`: it sits above this floor and
imports the specs, never the other way round. One loader for every reader of those files.

Example:
    >>> data_path("runtimes.yaml").name
    'runtimes.yaml'
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from autosearch.core._io import read_yaml_mapping
from autosearch.core.errors import SpecError


@functools.cache
def data_dir() -> Path:
    """The folder of the installed `cost_models` package."""
    spec = importlib.util.find_spec("cost_models")
    if spec is None or not spec.submodule_search_locations:
        raise SpecError(
            "the cost_models package is not installed; reinstall autosearch (pip install -e .)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def data_path(name: str) -> Path:
    """`cost_models/<name>` (a file or a folder such as ``profiles``)."""
    return data_dir() / name


def read_data(name: str, *, what: str, optional: bool = False) -> dict[str, Any]:
    """The YAML mapping of `cost_models/<name>`; with `optional`, an empty one where the file is
    not shipped (the bands: the estimate then says it has none)."""
    path = data_path(name)
    if optional and not path.exists():
        return {}
    return read_yaml_mapping(path, what=what)
