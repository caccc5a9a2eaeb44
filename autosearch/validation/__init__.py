"""Validation: run the top candidates for a few real steps and put measured next to predicted.

Example:
    >>> from autosearch import ModelSpec, Strategy
    >>> from autosearch.validation import validate
    >>> result = validate(  # doctest: +SKIP
    ...     ModelSpec.load("tiny-gpt"),
    ...     [Strategy(dp=2, global_batch_size=8)],
    ...     cluster="results/calibration/example-amd-epyc-2c.yaml:1x2",
    ...     out="results/val",
    ... )
    >>> result.best.strategy  # doctest: +SKIP
"""

from autosearch.validation._validate import (
    Candidate,
    ValidationResult,
    candidates_from_study,
    distinct_kinds,
    validate,
)

__all__ = [
    "Candidate",
    "ValidationResult",
    "candidates_from_study",
    "distinct_kinds",
    "validate",
]
