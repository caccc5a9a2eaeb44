"""A fused attention kernel's efficiency from its shape: keys per query, causality, head size.

A FlashAttention-style kernel (cuDNN's fused SDPA, FlashAttention-2/3) gives each thread block
a tile of queries and walks the key/value tiles those queries see, keeping the scores on chip.
Each query tile pays a fixed cost (loading Q, the pipeline's prologue, the softmax epilogue and
writing O) that the key tiles amortise, so the fraction of peak grows with the keys each query
visits, `k`, and saturates:

    efficiency(pass) = peak x head(d_qk) x k / (k + k_half)

`k` is the mean number of keys a query attends to: the kv sequence without a mask, half of it
under a causal mask, the window on a sliding layer. A causal mask has its own, larger `k_half`:
its query tiles see unequal numbers of key tiles (the SMs' last wave runs unevenly) and the
tiles on the diagonal are half masked. `head(d)` is the efficiency at head size d relative to
d = 128 (a head of 64 does half the math per key loaded; MLA's 192 / 128 scores and values),
linear between the sizes a profile lists. The backward pass (dQ, dK, dV: 2.5x the forward's
FLOPs) has its own three constants.

The constants are properties of a kernel on an architecture, fitted on a measured per-shape
table: cudnn-frontend's SDPA training benchmarks on H200, GB200 and GB300 (cost_models/data/
cudnn_sdpa_training.csv; benchmarks/attention_shapes.py fits and reports them, 2-5% mean error
against 20-100% for one flat efficiency). The same FLOPs as `cost_models/terms/compute.py`:
forward 2 b h s_q k (d_qk + d_v).

Written here by hand: no library predicts a fused attention kernel's time without a GPU.
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autosearch.core.errors import SpecError
from autosearch.core.schema import read_mapping

PASSES = ("fwd", "bwd")
REFERENCE_HEAD_DIM = 128


@dataclass(frozen=True)
class PassShape:
    """One pass's constants: the plateau (fraction of dense peak at d = 128 and many keys), the
    keys per query at half of it without a mask and under a causal mask, and the relative
    efficiency by head size."""

    peak: float
    keys_half: float
    causal_keys_half: float
    head_dim: tuple[tuple[int, float], ...] = ()  # (d_qk, relative efficiency), sorted

    def efficiency(self, keys: float, causal: bool, d_qk: int) -> float:
        half = self.causal_keys_half if causal else self.keys_half
        return self.peak * head_factor(self.head_dim, d_qk) * keys / (keys + half)


def head_factor(points: tuple[tuple[int, float], ...], d: int) -> float:
    """The relative efficiency at head size `d`: 1 at 128, linear between the listed sizes,
    the nearest listed one beyond them."""
    table = sorted(
        {**dict(points), REFERENCE_HEAD_DIM: dict(points).get(REFERENCE_HEAD_DIM, 1.0)}.items()
    )
    if d <= table[0][0]:
        return table[0][1]
    for (d0, e0), (d1, e1) in zip(table, table[1:]):
        if d <= d1:
            return e0 + (e1 - e0) * (d - d0) / (d1 - d0)
    return table[-1][1]


@dataclass(frozen=True)
class AttentionShapes:
    """A fused attention kernel's efficiency by shape on one architecture (forward, backward)."""

    fwd: PassShape
    bwd: PassShape

    def efficiencies(self, keys: float, causal: bool, d_qk: int) -> tuple[float, float]:
        """(forward, backward) fraction of dense peak for queries that each see `keys` keys."""
        return self.fwd.efficiency(keys, causal, d_qk), self.bwd.efficiency(keys, causal, d_qk)

    def scaled(self, factor: float) -> "AttentionShapes":
        """Every plateau times `factor` (a runtime reaching a fraction of this kernel)."""

        def one(p: PassShape) -> PassShape:
            return PassShape(p.peak * factor, p.keys_half, p.causal_keys_half, p.head_dim)

        return AttentionShapes(one(self.fwd), one(self.bwd))

    def to_dict(self) -> dict[str, Any]:
        return {
            name: {
                "peak": p.peak,
                "keys_half": p.keys_half,
                "causal_keys_half": p.causal_keys_half,
                **({"head_dim": dict(p.head_dim)} if p.head_dim else {}),
            }
            for name, p in (("fwd", self.fwd), ("bwd", self.bwd))
        }


def _positive(value: Any, what: str, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise SpecError(f"{what} = {value!r}; give a number in (0, {high:g}]")
    return float(value)


def parse_attention_shapes(spec: Any, what: str) -> dict[str, AttentionShapes]:
    """`attention.shapes` of a profile: `{kernel: {fwd: {...}, bwd: {...}}}`, checked."""
    out = {}
    for kernel, passes in read_mapping(spec, f"{what}: attention.shapes").items():
        where = f"{what}: attention.shapes.{kernel}"
        body = read_mapping(passes, where)
        unknown = sorted(set(body) - set(PASSES))
        missing = [p for p in PASSES if p not in body]
        if unknown or missing:
            raise SpecError(
                f"{where} needs exactly the passes fwd and bwd"
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
                + (f"; missing: {', '.join(missing)}" if missing else "")
            )
        shapes = []
        for p in PASSES:
            fields = read_mapping(body[p], f"{where}.{p}")
            extra = sorted(set(fields) - {"peak", "keys_half", "causal_keys_half", "head_dim"})
            if extra:
                raise SpecError(
                    f"{where}.{p}: unknown field(s) {', '.join(extra)}; a pass has peak, "
                    "keys_half, causal_keys_half and head_dim"
                )
            for key in ("peak", "keys_half", "causal_keys_half"):
                if key not in fields:
                    raise SpecError(f"{where}.{p}: missing {key}")
            heads = read_mapping(fields.get("head_dim", {}), f"{where}.{p}.head_dim")
            dims = []
            for d, e in heads.items():
                if not str(d).isdigit() or int(d) <= 0:
                    raise SpecError(f"{where}.{p}.head_dim: key {d!r} is not a head size")
                dims.append((int(d), _positive(e, f"{where}.{p}.head_dim.{d}", 4.0)))
            shapes.append(
                PassShape(
                    peak=_positive(fields["peak"], f"{where}.{p}.peak", 1.0),
                    keys_half=_positive(fields["keys_half"], f"{where}.{p}.keys_half", 1e7),
                    causal_keys_half=_positive(
                        fields["causal_keys_half"], f"{where}.{p}.causal_keys_half", 1e7
                    ),
                    head_dim=tuple(sorted(dims)),
                )
            )
        out[str(kernel)] = AttentionShapes(*shapes)
    return out
