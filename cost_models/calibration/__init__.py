"""Calibration, the torch-free half: what microbenchmarks of a real machine measured, fitted
(scipy) into a hardware profile, and the refit of correction terms from measured training runs.
Every calibrated profile carries the verdict of its own checks (`calibration.quality`);
`quality_problems(profile)` says why one must not be trusted. The microbenchmarks, their
workers and `calibrate` are on the torch side of the tree: `autosearch.calibration`.

Importing this package is cheap: the names below load their module on first use (PEP 562).

Example:
    >>> from cost_models.calibration import fit_alpha_beta
    >>> f = fit_alpha_beta(["send_recv"] * 3, [2] * 3, [1e3, 1e6, 1e8],
    ...                    [1.01e-4, 1.1e-3, 1.0001e-1])
    >>> round(f.bandwidth_bytes_per_s / 1e9, 1)
    1.0
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
    "cost_models.calibration.fit": (
        "AlphaBetaFit",
        "FitQuality",
        "GemmFit",
        "collective_coefficients",
        "fit_alpha_beta",
        "fit_attention",
        "fit_bandwidth",
        "fit_gemm",
        "fit_quality",
    ),
    "cost_models.calibration.profile": ("build_profile", "catalog_profile_for"),
    "cost_models.calibration.quality": ("Quality", "assess_quality", "quality_problems"),
    "cost_models.calibration.refit": ("RefitResult", "TERM_GROUPS", "refit_corrections"),
    "autosearch.calibration.runner": ("Plan", "make_plan"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports("cost_models.calibration", globals(), _WHERE)
