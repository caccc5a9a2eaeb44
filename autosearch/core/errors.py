"""The one exception type for input a user can get wrong.

`SpecError` is a `ValueError`, so callers that catch `ValueError` keep working; the CLI catches
it (and only it, with file and YAML errors) to print one clear message and exit with status 2,
so that a bug in autosearch itself still shows its traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


class SpecError(ValueError):
    """An invalid model, cluster, strategy or search input: what is wrong and how to fix it."""

    def __init__(self, problems: str | Iterable[str], *, context: str = ""):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = f"{context}: " if context else ""
        if len(self.problems) == 1:
            message = head + self.problems[0]
        else:
            message = (
                head
                + f"{len(self.problems)} problems:\n"
                + "\n".join(f"  - {p}" for p in self.problems)
            )
        super().__init__(message)
