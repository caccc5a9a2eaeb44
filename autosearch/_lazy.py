"""Lazy package exports (PEP 562), shared by the packages whose names pull in heavy imports
(torch, scipy): ``__getattr__, __dir__ = lazy_exports(__name__, globals(), {"Name": "module"})``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], where: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` that imports ``where[name]`` on first use (and caches it in `namespace`),
    and the matching `__dir__`."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
