"""Fits that turn microbenchmark medians into the terms of a hardware profile (numpy/scipy only).

Every fit minimises relative error (residual = log(predicted / measured)): measured times span
six orders of magnitude, and an absolute least-squares fit would ignore everything but the
largest points. Fit quality is reported the same way for every fit (`FitQuality`): R^2 of
log(time), the worst and the median relative residual, and the number of points.

The model forms are the cost model's own functions, called here, so that what is fitted is what
the cost model uses:
- GEMM: `GemmEfficiency.time_s` (autosearch.core.hardware), t = launch + 2mnk / (peak * eff_p)
  * (1 + h/m + h/n + h/k); a backward costs `gemm.backward_over_forward` x its forward.
- Fused attention: t_fwd = launch + F / (peak * eff_p) with F the causal forward FLOPs
  (`cost_models.analytic.CAUSAL_FRACTION`), t_bwd = `attention.backward_over_forward` x t_fwd.
- Streaming memory: t = launch + bytes / bandwidth (McCalpin's STREAM, arrays >= 4x the
  last-level cache).
- Collectives: the ring alpha-beta functions of `cost_models.formulas` (Thakur et al. 2005),
  t = a_op(n) * alpha + b_op(n) * S / beta, with (a, b) read off those functions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import least_squares

from autosearch.core.hardware import GemmEfficiency
from cost_models import formulas
from cost_models.analytic import CAUSAL_FRACTION


@dataclass(frozen=True)
class FitQuality:
    """How well a fitted form reproduces the measurements it was fitted on.

    r2_log: coefficient of determination of log(time) (1 = perfect, 0 = no better than the mean).
    worst_rel_residual: largest |predicted / measured - 1| over the points.
    median_rel_residual: median |predicted / measured - 1|.
    n_points: number of measurements used.
    """

    r2_log: float
    worst_rel_residual: float
    median_rel_residual: float
    n_points: int

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (round(float(v), 4) if isinstance(v, float) else v) for k, v in asdict(self).items()
        }


def fit_quality(predicted: ArrayLike, measured: ArrayLike) -> FitQuality:
    p = np.asarray(predicted, dtype=float)
    y = np.asarray(measured, dtype=float)
    lp, ly = np.log(p), np.log(y)
    ss_res = float(np.sum((ly - lp) ** 2))
    ss_tot = float(np.sum((ly - ly.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel = np.abs(p / y - 1.0)
    return FitQuality(r2, float(rel.max()), float(np.median(rel)), int(len(y)))


def _check(times: np.ndarray, what: str, *, min_points: int) -> None:
    if len(times) < min_points:
        raise ValueError(
            f"{what}: need at least {min_points} measurements to fit, got {len(times)}"
        )
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ValueError(f"{what}: measured times must be finite and > 0")


# ---------------------------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmFit:
    """rate_flops[p]: asymptotic (large-shape) rate of precision p = peak * max_efficiency[p]."""

    rate_flops: dict[str, float]
    half_dim: float
    launch_s: float
    quality: FitQuality
    quality_by_precision: dict[str, FitQuality]

    def predict(self, m, n, k, precision, multiplier=1.0) -> np.ndarray:
        return gemm_time_s(
            m, n, k, self.rate_flops, precision, self.half_dim, self.launch_s, multiplier
        )


def gemm_time_s(
    m,
    n,
    k,
    rate_flops: dict[str, float],
    precision,
    half_dim: float,
    launch_s: float,
    multiplier=1.0,
    *,
    tiles_of: GemmEfficiency | None = None,
) -> np.ndarray:
    """`GemmEfficiency.time_s`, the cost model's GEMM time, for arrays of shapes and precisions.

    rate_flops[p] stands for peak * max_efficiency[p]: the function is evaluated with peak 1 and
    max_efficiency = the rates. `multiplier` scales the whole time (1 + backward_over_forward for
    a forward + backward pair). With `tiles_of` (a profile's `gemm`), its SM count, tiles and K
    overhead price the shapes instead of `half_dim` (`autosearch.core.gemm_tiles`)."""
    m, n, k = (np.atleast_1d(np.asarray(x, dtype=float)) for x in (m, n, k))
    prec = np.broadcast_to(np.atleast_1d(np.asarray(precision, dtype=object)), m.shape)
    gemm = GemmEfficiency(max_efficiency=dict(rate_flops), half_dim=half_dim, launch_s=launch_s)
    if tiles_of is not None:
        gemm = dataclasses.replace(
            gemm,
            sm_count=tiles_of.sm_count,
            tiles=tiles_of.tiles,
            k_overhead_bytes=tiles_of.k_overhead_bytes,
        )
        t = np.array([gemm.time_s(a, b, c, 1.0, p) for a, b, c, p in zip(m, n, k, prec)])
        return np.asarray(multiplier, dtype=float) * t  # tiles and waves: one shape at a time
    t = np.empty(m.shape)
    for p in set(prec.tolist()):
        sel = prec == p
        t[sel] = gemm.time_s(m[sel], n[sel], k[sel], 1.0, p)
    return np.asarray(multiplier, dtype=float) * t


def _fit_rates(what, m, n, k, precision, time_s, multiplier, time_of, extra0):
    """Least squares in log time of one rate per precision and the positive terms `extra0`
    shared by all precisions, for a GEMM form `time_of(m, n, k, prec, mult, rates, extras)`.
    Starts from each precision's best observed rate. Returns (rates, extras, the quality, the
    quality per precision)."""
    m, n, k, t = (np.asarray(x, dtype=float) for x in (m, n, k, time_s))
    prec = np.asarray(precision, dtype=object)
    mult = np.broadcast_to(np.asarray(multiplier, dtype=float), t.shape)
    _check(t, what, min_points=3)
    names = sorted(set(prec.tolist()))
    idx = np.array([names.index(p) for p in prec])
    flops = 2.0 * m * n * k
    rate0 = np.array(
        [np.max(mult[idx == i] * flops[idx == i] / t[idx == i]) for i in range(len(names))]
    )
    x0 = np.log(np.concatenate([rate0, [e(t) if callable(e) else e for e in extra0]]))

    def unpack(x):
        return dict(zip(names, np.exp(x[: len(names)]))), np.exp(x[len(names) :])

    def resid(x):
        return np.log(time_of(m, n, k, prec, mult, *unpack(x)) / t)

    sol = least_squares(resid, x0, loss="soft_l1", f_scale=0.3)
    rates, extras = unpack(sol.x)
    pred = np.exp(resid(sol.x)) * t
    by_prec = {
        p: fit_quality(pred[idx == i], t[idx == i])
        for i, p in enumerate(names)
        if np.sum(idx == i) >= 2
    }
    return {p: float(rates[p]) for p in names}, extras, fit_quality(pred, t), by_prec


def _launch0(t: np.ndarray) -> float:
    return max(float(t.min()) / 4, 1e-9)  # a launch start: the fastest call / 4


def fit_gemm(m, n, k, precision, time_s, *, multiplier=1.0) -> GemmFit:
    """Fit one asymptotic rate per precision, and one half_dim and launch_s shared by all
    (the GemmEfficiency form). `multiplier` scales each point's time: 1 for a forward GEMM,
    r for its backward, 1 + r for both (r = gemm.backward_over_forward)."""

    def time_of(m, n, k, prec, mult, rates, extras):
        return gemm_time_s(m, n, k, rates, prec, extras[0], extras[1], mult)

    rates, (hd, launch), quality, by_prec = _fit_rates(
        "GEMM fit", m, n, k, precision, time_s, multiplier, time_of, [16.0, _launch0]
    )
    return GemmFit(rates, float(hd), float(launch), quality, by_prec)


@dataclass(frozen=True)
class TiledGemmFit:
    """The GEMM measurements read by the tile model of a catalog profile
    (`autosearch.core.gemm_tiles`: its SM count, tile shapes and K overhead kept): one
    large-shape rate per precision and one launch time fitted."""

    rate_flops: dict[str, float]
    launch_s: float
    quality: FitQuality
    quality_by_precision: dict[str, FitQuality]
    shapes: GemmEfficiency

    def predict(self, m, n, k, precision, multiplier=1.0) -> np.ndarray:
        return gemm_time_s(
            m,
            n,
            k,
            self.rate_flops,
            precision,
            self.shapes.half_dim,
            self.launch_s,
            multiplier,
            tiles_of=self.shapes,
        )


def fit_gemm_tiled(
    m, n, k, precision, time_s, *, shapes: GemmEfficiency, multiplier=1.0
) -> TiledGemmFit:
    """Fit one large-shape rate per precision and a launch time under the tile model of
    `shapes` (a profile's `gemm` with `sm_count` and `tiles`): the tile shapes and the K
    overhead are properties of an architecture's kernels, fitted on a table of hundreds of
    shapes (benchmarks/gemm_tiles.py), which `calibrate`'s few shapes per precision could not
    pin down; the rate and the launch are this device's. Same residuals as `fit_gemm`."""
    if not shapes.tiles or shapes.sm_count < 1:
        raise ValueError("fit_gemm_tiled needs a gemm with sm_count and tiles")

    def time_of(m, n, k, prec, mult, rates, extras):
        return gemm_time_s(m, n, k, rates, prec, shapes.half_dim, extras[0], mult, tiles_of=shapes)

    rates, (launch,), quality, by_prec = _fit_rates(
        "GEMM tile fit", m, n, k, precision, time_s, multiplier, time_of, [_launch0]
    )
    return TiledGemmFit(rates, float(launch), quality, by_prec, shapes)


def mean_rel_residual(predicted: ArrayLike, measured: ArrayLike) -> float:
    """The mean |predicted / measured - 1|: what `fit_gemm_term` compares two GEMM forms by."""
    return float(np.mean(np.abs(np.asarray(predicted, float) / np.asarray(measured, float) - 1)))


# ---------------------------------------------------------------------------------------------
# Fused attention
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionFit:
    """rate_flops: achieved rate of fused attention (peak * attention efficiency)."""

    rate_flops: float
    quality: FitQuality


def attention_flops(batch, heads, seq_len, head_dim, *, causal: bool = True) -> np.ndarray:
    """Forward FLOPs of QK^T and softmax(.)V: 4 b a s^2 d, halved with a causal mask
    (as AnalyticCostModel counts them, CAUSAL_FRACTION)."""
    b, a, s, d = (np.asarray(x, dtype=float) for x in (batch, heads, seq_len, head_dim))
    return 4.0 * b * a * s * s * d * (CAUSAL_FRACTION if causal else 1.0)


def fit_attention(flops, time_s, *, launch_s: float, multiplier=1.0) -> AttentionFit:
    """Fit one rate to t = multiplier * (launch + F / rate), F the forward FLOPs; multiplier 1 for
    a forward, r for a backward, 1 + r for both (r = the profile's
    attention.backward_over_forward)."""
    f, t = np.asarray(flops, dtype=float), np.asarray(time_s, dtype=float)
    _check(t, "attention fit", min_points=1)
    mult = np.broadcast_to(np.asarray(multiplier, dtype=float), t.shape)

    def resid(x):
        return np.log(mult * (launch_s + f / np.exp(x[0])) / t)

    x0 = [np.log(np.median(mult * f / t))]
    sol = least_squares(resid, x0, loss="soft_l1", f_scale=0.3)
    pred = np.exp(resid(sol.x)) * t
    return AttentionFit(float(np.exp(sol.x[0])), fit_quality(pred, t))


# ---------------------------------------------------------------------------------------------
# Streaming memory bandwidth
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BandwidthFit:
    bandwidth_bytes_per_s: float
    launch_s: float
    quality: FitQuality


def fit_bandwidth(nbytes, time_s, *, launch_s: float | None = None) -> BandwidthFit:
    """t = launch + bytes / bandwidth. With `launch_s` given, only the bandwidth is fitted."""
    b, t = np.asarray(nbytes, dtype=float), np.asarray(time_s, dtype=float)
    _check(t, "bandwidth fit", min_points=1 if launch_s is not None else 2)
    fixed = launch_s is not None

    def unpack(x):
        return np.exp(x[0]), (launch_s if fixed else np.exp(x[1]))

    def resid(x):
        bw, launch = unpack(x)
        return np.log((launch + b / bw) / t)

    x0 = [np.log(np.max(b / t))] + ([] if fixed else [np.log(max(t.min() / 4, 1e-9))])
    sol = least_squares(resid, x0, loss="soft_l1", f_scale=0.3)
    bw, launch = unpack(sol.x)
    pred = np.exp(resid(sol.x)) * t
    return BandwidthFit(float(bw), float(launch), fit_quality(pred, t))


# ---------------------------------------------------------------------------------------------
# Collectives: alpha-beta
# ---------------------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def collective_coefficients(op: str, group: int) -> tuple[float, float]:
    """(a, b) such that t = a alpha + b S / beta for `op` over `group` ranks, S the full buffer
    (all-reduce input, all-gather output, reduce-scatter input; one message for send/recv).

    Read off the cost model's own functions (`cost_models.formulas`, Thakur, Rabenseifner &
    Gropp 2005, sec. 4), which are linear in alpha and 1/beta: a = t(S=0, alpha=1),
    b = t(S=1, alpha=0, beta=1). For a ring all-reduce, (2(n-1), 2(n-1)/n)."""
    ring = {
        "all_reduce": formulas.ring_all_reduce_time_s,
        "all_gather": formulas.ring_all_gather_time_s,
        "reduce_scatter": formulas.ring_reduce_scatter_time_s,
    }
    if op == "send_recv":
        return formulas.p2p_time_s(0.0, 1.0, 1.0), formulas.p2p_time_s(1.0, 0.0, 1.0)
    if op in ring:
        return ring[op](0.0, group, 1.0, 1.0), ring[op](1.0, group, 0.0, 1.0)
    raise ValueError(f"unknown collective {op!r}; expected one of {COLLECTIVES}")


@dataclass(frozen=True)
class AlphaBetaFit:
    latency_s: float
    bandwidth_bytes_per_s: float
    quality: FitQuality

    def predict(self, op: str, group: int, nbytes) -> np.ndarray:
        a, b = collective_coefficients(op, group)
        return (
            a * self.latency_s + b * np.asarray(nbytes, dtype=float) / self.bandwidth_bytes_per_s
        )


def fit_alpha_beta(ops: Sequence[str], groups: Sequence[int], nbytes, time_s) -> AlphaBetaFit:
    """One (alpha, beta) for every (op, group size, message size) point given."""
    t, s = np.asarray(time_s, dtype=float), np.asarray(nbytes, dtype=float)
    _check(t, "alpha-beta fit", min_points=2)
    coef = np.array([collective_coefficients(o, int(g)) for o, g in zip(ops, groups)], dtype=float)
    a, b = coef[:, 0], coef[:, 1]

    def resid(x):
        return np.log((a * np.exp(x[0]) + b * s / np.exp(x[1])) / t)

    small, large = np.argmin(s), np.argmax(s)
    x0 = [np.log(max(t[small] / a[small], 1e-9)), np.log(max(b[large] * s[large] / t[large], 1.0))]
    sol = least_squares(resid, x0, loss="soft_l1", f_scale=0.3)
    pred = np.exp(resid(sol.x)) * t
    return AlphaBetaFit(float(np.exp(sol.x[0])), float(np.exp(sol.x[1])), fit_quality(pred, t))
