"""Calibration, the torch side: microbenchmarks of a real machine (GEMM by shape and dtype,
attention, memory bandwidth, collectives by size and group) run in worker processes, and
`calibrate`, which runs them and fits what they measure into a hardware profile with the
torch-free fitting of `cost_models.calibration` (fit, profile, quality, refit).

Importing this package is cheap and never imports torch: the names below load their module on
first use (PEP 562); torch is imported by the workers (`_worker.py`, `microbench.py`) and where a
device is probed.

Example:
    >>> from autosearch.calibration import make_plan
    >>> make_plan("cpu", quick=True).device
    'cpu'
"""

from __future__ import annotations

from autosearch._lazy import lazy_exports

_EXPORTS = {
    "autosearch.calibration._calibrate": (
        "CalibrationResult",
        "calibrate",
        "default_world_sizes",
        "write_profile",
    ),
    "autosearch.calibration.runner": ("Plan", "make_plan"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports("autosearch.calibration", globals(), _WHERE)
