"""The user's model factory, ``"package.module:function"`` or ``"path/to/file.py:function"``: a
function ModelSpec -> nn.Module. Importing it runs the user's code, in the process that calls
`validate` (once, to check it) and on every rank of every run: it must be trusted code.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autosearch.core.errors import SpecError


def load_factory(path: str) -> Callable[[Any], Any]:
    """The function `path` names; SpecError saying what is wrong when it cannot be had."""
    where, sep, name = str(path).rpartition(":")
    if not sep or not where or not name:
        raise SpecError(
            f"--factory {path!r} is not 'package.module:function' or 'file.py:function'"
        )
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise SpecError(f"--factory {path!r}: no file {where!r}")
            spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            if spec is None or spec.loader is None:
                raise SpecError(f"--factory {path!r}: {where!r} cannot be imported")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except SpecError:
        raise
    except ImportError as exc:
        raise SpecError(
            f"--factory {path!r}: cannot import {where!r} ({exc}); give an importable module "
            "(on PYTHONPATH) or a .py file path"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise SpecError(
            f"--factory {path!r}: importing {where!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    factory = getattr(module, name, None)
    if factory is None:
        raise SpecError(f"--factory {path!r}: {where!r} has no attribute {name!r}")
    if not callable(factory):
        raise SpecError(
            f"--factory {path!r}: {name!r} is a {type(factory).__name__}, not a function "
            "ModelSpec -> nn.Module"
        )
    return factory


def check_factory(path: str) -> None:
    """Import the factory once and check it takes one argument (the ModelSpec), before any run."""
    factory = load_factory(path)
    try:
        inspect.signature(factory).bind(object())
    except TypeError as exc:
        raise SpecError(
            f"--factory {path!r}: it must take one argument, the ModelSpec ({exc})"
        ) from exc
    except ValueError:  # a builtin without a signature: let the run tell
        pass
