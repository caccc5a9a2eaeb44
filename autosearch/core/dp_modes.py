"""How data parallelism runs for a ZeRO stage: the one table the Engine and the cost model read.

`dp_mode(zero_stage=..., dp=..., tp=..., pp=...)` names the torch.distributed mechanism that runs
over the data-parallel group and what it implies, as named properties. The Engine
(`autosearch/engine/parallelize.py`) builds exactly this; the analytic cost model
(`cost_models/terms/data_parallel.py`) charges exactly this; `tests/test_dp_modes.py` checks both
against the table, and `docs/engine.md` carries the table that `markdown_table()` prints.

Why these mechanisms (torch 2.13): DDP rejects DTensor parameters (tp > 1), and inside
`torch.distributed.pipelining` (pp > 1) its reducer fails on the first 1F1B step, so with tp or
pp every stage runs on FSDP2; `ZeroRedundancyOptimizer` broadcasts plain tensors and fails on
DTensor, so ZeRO-1 with tp or pp is FSDP2 without resharding after forward, reduced once per step
(it also shards gradients and parameters between steps: less memory than ZeRO-1). The same holds
with expert parallelism (ep > 1): the expert weights are DTensors over the ep mesh, and FSDP2
shards them over their expert-data-parallel group, the rest over dp (torchtitan's layout).
`torch.distributed.pipelining` skips the gradient sync and the reshard after backward for all but
the last micro-batch, so under pp gradients are reduced once per step and accumulate unsharded.

Example:
    >>> from autosearch.core import dp_mode
    >>> m = dp_mode(zero_stage=3, dp=8, tp=1, pp=1)
    >>> m.name, m.wrapper, m.reshard_after_forward, m.reduce_every_microbatch
    ('fsdp_zero3', 'fsdp', True, True)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autosearch.core.errors import SpecError

DP_MODE_NAMES = ("none", "ddp", "hsdp", "ddp_zero1", "fsdp_zero1", "fsdp_zero2", "fsdp_zero3")

_DESCRIPTIONS = {
    "none": "nothing to replicate or shard (dp = 1)",
    "ddp": (
        "DDP: one bucketed fp32 gradient all-reduce per step (`no_sync` before), overlapped "
        "with backward"
    ),
    "hsdp": (
        "FSDP2 on a (dp, 1) HSDP mesh, i.e. replicate-only: the same single all-reduce per step"
    ),
    "ddp_zero1": (
        "DDP + `ZeroRedundancyOptimizer`: optimizer states sharded; each rank broadcasts "
        "the parameters it updated"
    ),
    "fsdp_zero1": "FSDP2 `reshard_after_forward=False`, gradients reduce-scattered once per step",
    "fsdp_zero2": (
        "FSDP2 `reshard_after_forward=False`: parameters gathered once per micro-batch, "
        "gradients reduce-scattered every micro-batch (once per step under pp)"
    ),
    "fsdp_zero3": (
        "FSDP2 `reshard_after_forward=True`: as zero 2, and parameters gathered again for backward"
    ),
}


@dataclass(frozen=True, kw_only=True)
class DPMode:
    """What runs over the data-parallel group, and what it implies for time and memory.

    Attributes:
        name: one of `DP_MODE_NAMES`.
        wrapper: ``none``, ``ddp`` or ``fsdp`` (FSDP2 ``fully_shard``).
        hsdp_replicate: FSDP2 on a (dp, 1) mesh: parameters replicated, not sharded.
        zero_redundancy_optimizer: the optimizer is `ZeroRedundancyOptimizer` over dp.
        shards_optimizer: optimizer states are split over dp.
        shards_params: parameters are stored sharded between steps (FSDP over dp > 1).
        shards_grads: gradients are sharded when the optimizer steps.
        reshard_after_forward: gathered parameters are freed after forward and gathered again
            for backward (ZeRO-3).
        reduce_every_microbatch: gradients are reduced after every micro-batch, else once per
            step (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``, or pipelining).
        gathers_every_microbatch: sharded parameters are all-gathered for every micro-batch's
            forward, else once per step (pipelining keeps them gathered between micro-batches).
        grads_accumulate_unsharded: sharded parameters whose gradients accumulate whole (fp32)
            between micro-batches, reduce-scattered once at the end of the step.
        broadcasts_params_after_step: each rank sends the parameters it updated to all others.
        mixed_precision_policy: FSDP2 gathers parameters in the amp dtype and reduces in fp32
            (``MixedPrecisionPolicy``); otherwise autocast casts fp32 parameters per use.
    """

    name: str
    wrapper: str
    hsdp_replicate: bool = False
    zero_redundancy_optimizer: bool = False
    shards_optimizer: bool = False
    shards_params: bool = False
    shards_grads: bool = False
    reshard_after_forward: bool = False
    reduce_every_microbatch: bool = False
    gathers_every_microbatch: bool = False
    grads_accumulate_unsharded: bool = False
    broadcasts_params_after_step: bool = False
    mixed_precision_policy: bool = False

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self.name]


@functools.cache
def dp_mode(*, zero_stage: int, dp: int, tp: int = 1, pp: int = 1, ep: int = 1) -> DPMode:
    """The data-parallel mode of a strategy (see the module docstring for why).

    Raises:
        SpecError: zero_stage is not 0-3, or a degree is not a positive integer.
    """
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise SpecError(f"zero_stage must be 0, 1, 2 or 3; got {zero_stage!r}")
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"{name} must be a positive integer; got {value!r}")
    if dp == 1:
        return DPMode(name="none", wrapper="none")
    model_parallel = tp > 1 or pp > 1
    if zero_stage == 0:
        if model_parallel:
            return DPMode(name="hsdp", wrapper="fsdp", hsdp_replicate=True)
        return DPMode(name="ddp", wrapper="ddp")
    if zero_stage == 1 and not model_parallel and ep == 1:
        return DPMode(
            name="ddp_zero1",
            wrapper="ddp",
            zero_redundancy_optimizer=True,
            shards_optimizer=True,
            broadcasts_params_after_step=True,
        )
    reduce_every = zero_stage >= 2 and pp == 1
    return DPMode(
        name=f"fsdp_zero{zero_stage}",
        wrapper="fsdp",
        shards_optimizer=True,
        shards_params=True,
        shards_grads=True,
        reshard_after_forward=zero_stage == 3,
        reduce_every_microbatch=reduce_every,
        gathers_every_microbatch=pp == 1 or zero_stage == 3,
        grads_accumulate_unsharded=not reduce_every,
        mixed_precision_policy=zero_stage >= 2,
    )


def markdown_table() -> str:
    """The ZeRO -> mechanism table as Markdown (docs/engine.md carries it; a test compares)."""
    rows = ["| zero | tp = pp = 1 | tp > 1 or pp > 1 |", "|---|---|---|"]
    for zero in (0, 1, 2, 3):
        plain = dp_mode(zero_stage=zero, dp=2)
        parallel = dp_mode(zero_stage=zero, dp=2, tp=2)
        rows.append(
            f"| {zero} | {plain.description} | "
            f"{'same' if parallel == plain else parallel.description} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover - prints the table for the docs
    print(markdown_table())
