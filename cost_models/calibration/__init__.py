"""Calibration: microbenchmarks of a real machine, fitted (scipy) into a hardware profile, and the
refit of correction terms from measured training runs.

`import cost_models.calibration` does not import torch: the benchmarks run in worker processes
(`_worker.py`, `microbench.py`), and everything here is numpy / scipy / pandas.

Example:
    >>> from cost_models.calibration import fit_alpha_beta
    >>> f = fit_alpha_beta(["send_recv"] * 3, [2] * 3, [1e3, 1e6, 1e8], [1.1e-4, 1.1e-3, 1.0e-1])
    >>> round(f.bandwidth_bytes_per_s / 1e9, 1)
    1.0
"""
from cost_models.calibration.calibrate import CalibrationResult, calibrate, default_world_sizes, write_profile
from cost_models.calibration.fit import (
    AlphaBetaFit,
    FitQuality,
    GemmFit,
    collective_coefficients,
    fit_alpha_beta,
    fit_attention,
    fit_bandwidth,
    fit_gemm,
    fit_quality,
)
from cost_models.calibration.profile import build_profile, catalog_profile_for
from cost_models.calibration.refit import RefitResult, refit_corrections
from cost_models.calibration.runner import Plan, make_plan

__all__ = [
    "AlphaBetaFit", "CalibrationResult", "FitQuality", "GemmFit", "Plan", "RefitResult", "build_profile",
    "calibrate", "catalog_profile_for", "collective_coefficients", "default_world_sizes", "fit_alpha_beta",
    "fit_attention", "fit_bandwidth", "fit_gemm", "fit_quality", "make_plan", "refit_corrections", "write_profile",
]
