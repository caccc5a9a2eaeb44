import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(
    0, str(ROOT / "benchmarks")
)  # tests may reuse benchmark helpers (e.g. the SC'21 table)
os.environ.setdefault("MPLBACKEND", "Agg")
