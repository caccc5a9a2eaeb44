import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(
    0, str(ROOT / "benchmarks")
)  # tests may reuse benchmark helpers (e.g. the SC'21 table)
os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


# The longest files (minutes each on a 2-core machine: examples, multi-process launches, whole
# search spaces) go first (the order within a file is kept). Serial runs and xdist with
# `--no-loadscope-reorder` keep this order; plain `--dist loadfile` (xdist 3.x) re-sorts files by
# their number of tests, which puts the one-test example file last.
LONG_FILES = (
    "test_engine_example_hf.py",
    "test_search_spaces.py",
    "test_engine_parity_parallel.py",
    "test_engine_parallel.py",
    "test_engine_hf_gpt.py",
    "test_engine_checkpoint_faults.py",
    "test_dimensions.py",
    "test_validation.py",
)


def pytest_collection_modifyitems(config, items):
    """Run the long files first; skip the `cuda` tests where torch sees no GPU (torch is
    imported only if there are any)."""
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in cuda:
        item.add_marker(skip)
