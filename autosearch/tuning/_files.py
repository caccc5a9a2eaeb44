"""The file helpers of `autosearch.core._files`, under their historical import path."""

from autosearch.core._files import (
    TEMP_PREFIX,
    TEMP_SUFFIX,
    FileLock,
    atomic_write,
    remove_stale_temp_files,
)

__all__ = ["TEMP_PREFIX", "TEMP_SUFFIX", "FileLock", "atomic_write", "remove_stale_temp_files"]
