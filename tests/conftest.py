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


def pytest_collection_modifyitems(config, items):
    """Skip the `extended` tests unless the -m expression names them, and the `cuda` tests where
    torch sees no GPU (torch is imported only if there are any)."""
    if "extended" not in (config.option.markexpr or ""):
        skip_extended = pytest.mark.skip(reason="the extended matrix: run with -m extended")
        for item in items:
            if item.get_closest_marker("extended"):
                item.add_marker(skip_extended)
    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in cuda:
        item.add_marker(skip)
