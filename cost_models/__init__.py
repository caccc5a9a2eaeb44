"""The analytic compute / communication / memory model, hardware profiles, and calibration.

Pure Python: importing this package never imports torch.
"""

from autosearch.core.hardware import GemmEfficiency, HardwareProfile, Link, profile_names
from autosearch.core.report import CostReport, MemoryBreakdown, TimeBreakdown
from autosearch.core.runtime import MEGATRON_SC21, RUNTIMES, TORCH, RuntimeOptions
from cost_models._base import CostModel
from cost_models.analytic import AnalyticCostModel, estimate

__all__ = [
    "AnalyticCostModel",
    "CostModel",
    "CostReport",
    "GemmEfficiency",
    "HardwareProfile",
    "Link",
    "MEGATRON_SC21",
    "MemoryBreakdown",
    "RUNTIMES",
    "RuntimeOptions",
    "TORCH",
    "TimeBreakdown",
    "estimate",
    "profile_names",
]
