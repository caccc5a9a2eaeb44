"""A GEMM's time from its shape: output tiles, waves of tiles over the GPU's SMs, and the K loop.

A GPU GEMM library (cuBLAS, CUTLASS) cuts the m x n output into tiles of tm x tn, one per
thread block (on Hopper and Blackwell a persistent kernel walks the tiles), and the SMs take
the tiles in waves: ceil(tiles / SMs) of them, the last one partly idle. Each tile runs the K
loop, whose prologue (filling the shared-memory pipeline) and epilogue (writing the tile) cost
a fixed number of K bytes. The library picks the tile shape that finishes first; smaller
tiles waste less on ragged edges and fill the SMs sooner, larger ones reuse each loaded
operand more (Volkov & Demmel 2008; NVIDIA "Matrix Multiplication Background User's Guide",
sections "Tile Quantization" and "Wave Quantization"; CUTLASS's tile schedulers).

    time(m, n, k) = launch + min over tiles of
        ceil(ceil(m / tm) ceil(n / tn) / SMs) x 2 tm tn (k + k0) / (peak / SMs x max_eff x e_tile)

`e_tile` is each tile shape's efficiency relative to the best one and `k0` = k_overhead_bytes
/ the operand's bytes; both are properties of an architecture's kernels, fitted on a measured
per-shape table (XLA's default matmul performance tables, cost_models/data/
xla_matmul_perf.csv; benchmarks/gemm_tiles.py fits and reports them). `max_eff` stays the
profile's large-shape ceiling. `groups` > 1 prices a grouped GEMM whose groups' tiles share
the SMs; the MoE experts do not use it (cost_models/terms/experts.py `grouped_gemm_s`: on the
H200's measured grouped GEMMs it reads worse than each group on the smooth curve).

Written here by hand: no library models cuBLAS's tile choice without a GPU (the libraries'
own heuristics run on the device). Pure Python, no torch.
"""

from __future__ import annotations

import functools
import math

from autosearch.core.errors import SpecError

# Bytes of one operand element by precision key of `GemmEfficiency.max_efficiency`: the K
# overhead is a fixed number of K bytes of the shared-memory pipeline (an fp8 tile's K step
# is twice a 16-bit one's in elements, CUTLASS's Hopper kernels: 64 x 2 bytes = 128 x 1 byte).
OPERAND_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "fp8_rowwise": 1}

Tile = tuple[int, int, float]  # (rows, columns, efficiency relative to the best tile)


@functools.lru_cache(maxsize=65536)
def tiled_time_s(
    groups: float,
    m: float,
    n: float,
    k: float,
    rate_flops: float,
    sm_count: int,
    tiles: tuple[Tile, ...],
    k_overhead: float,
) -> float:
    """Seconds of `groups` GEMMs of m x n x k in one launch (the launch not included), at
    `rate_flops` = peak x the large-shape efficiency over the whole GPU, with the tile shape
    that finishes first. `k_overhead` is in K elements. Shapes repeat across the search's
    estimates, so the answers are cached."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    per_sm = rate_flops / sm_count
    work_k = k + k_overhead
    best = math.inf
    for tm, tn, eff in tiles:
        count = groups * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(count / sm_count)
        best = min(best, waves * 2.0 * tm * tn * work_k / (per_sm * eff))
    return best


def parse_tiles(spec: dict, what: str) -> tuple[Tile, ...]:
    """`{"128x256": 1.0, ...}` from a profile into ((128, 256, 1.0), ...), checked."""
    out = []
    for key, eff in spec.items():
        parts = str(key).lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SpecError(
                f"{what}: gemm.tiles key {key!r} is not a tile shape; write ROWSxCOLUMNS "
                "(e.g. 128x256: 1.0)"
            )
        if not isinstance(eff, (int, float)) or not 0 < float(eff) <= 1:
            raise SpecError(
                f"{what}: gemm.tiles.{key} = {eff!r}; give the tile's efficiency relative to "
                "the best tile, in (0, 1]"
            )
        out.append((int(parts[0]), int(parts[1]), float(eff)))
    return tuple(out)
