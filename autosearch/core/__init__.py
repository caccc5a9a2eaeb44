"""The floor: the torch-free vocabulary every other part of autosearch imports.

Errors, the model spec and its catalog, the strategy and its rules, the cluster and hardware
profile, the runtime options, the cost report, and the one table of data-parallel modes. Modules
here import only each other (and PyYAML); `cost_models`, `search_spaces`, the tuner, validation,
the Engine and the CLI sit above and import from here, never the other way round
(`pyproject.toml` declares the layers; `lint-imports` checks them).
"""

from autosearch.core.dp_modes import DP_MODE_NAMES, DPMode, dp_mode
from autosearch.core.errors import SpecError
from autosearch.core.hardware import GemmEfficiency, HardwareProfile, Link, profile_names
from autosearch.core.model_spec import ModelSpec, model_catalog
from autosearch.core.report import CostReport, MemoryBreakdown, TimeBreakdown
from autosearch.core.runtime import MEGATRON_SC21, RUNTIMES, TORCH, RuntimeOptions
from autosearch.core.strategy import Strategy

__all__ = [
    "CostReport",
    "DPMode",
    "DP_MODE_NAMES",
    "GemmEfficiency",
    "HardwareProfile",
    "Link",
    "MEGATRON_SC21",
    "MemoryBreakdown",
    "ModelSpec",
    "RUNTIMES",
    "RuntimeOptions",
    "SpecError",
    "Strategy",
    "TORCH",
    "TimeBreakdown",
    "dp_mode",
    "model_catalog",
    "profile_names",
]
