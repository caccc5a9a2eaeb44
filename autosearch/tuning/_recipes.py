"""Known-good starting points, enqueued before the sampler takes over.

The usual recipes of practitioners (Narayanan et al. 2021, sec. 3.3 "takeaways"; the torchtitan and
Megatron-LM defaults): tensor parallel up to the GPUs of one node, pipeline parallel only as much
as memory needs, data parallel for the rest, selective recompute before full recompute; or, for a
model that fits with sharding alone, plain FSDP (ZeRO-3, dp = every device). Each recipe is the
first strategy of its family, in preference order, that fits in memory according to the cost
model; a family with nothing that fits contributes its least hungry member.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.strategy import Strategy
    from cost_models._base import CostModel
    from search_spaces import BaseSearchSpace


def recipes(
    space: "BaseSearchSpace", cost_model: "CostModel", *, limit: int = 4
) -> list["Strategy"]:
    """Up to `limit` distinct recipe strategies that belong to `space`."""
    from autosearch.core.strategy import Strategy

    world, gpn = space.cluster.world_size, space.cluster.gpus_per_node
    model, gbs = space.model, space.global_batch_size
    amp = next(
        (a for a in ("bf16", "fp16", "fp32") if a in space.cluster.profile.peak_flops), "bf16"
    )
    tps = sorted({t for t in (1, 2, 4, 8, 16) if t <= gpn and world % t == 0}, reverse=True)
    pps = [p for p in range(1, model.n_layers + 1) if model.n_layers % p == 0]

    def family(tp_values, pp_values, mbs, rcs, zeros, sp: bool) -> list[Strategy]:
        out = []
        for tp in tp_values:
            for pp in pp_values:
                if world % (tp * pp):
                    continue
                dp = world // (tp * pp)
                for rc in rcs:
                    for mb in mbs:
                        for zero in zeros:
                            schedule = "1f1b"
                            try:
                                s = Strategy(
                                    dp=dp,
                                    tp=tp,
                                    pp=pp,
                                    micro_batch_size=mb,
                                    global_batch_size=gbs,
                                    pipeline_schedule=schedule,
                                    recompute=rc,
                                    sequence_parallel=sp and tp > 1,
                                    zero_stage=zero,
                                    amp=amp,
                                )
                            except ValueError:
                                continue
                            if s in space:
                                out.append(s)
        return out

    families = [
        # Megatron-LM: tp = a node, the smallest pp that fits, selective then full recompute.
        family(tps[:1], pps, (1, 2), ("selective", "full"), (1, 0), True),
        # FSDP: every device data parallel, parameters sharded.
        family((1,), (1,), (1, 2, 4), ("none", "selective", "full"), (3,), False),
        # tp inside the node, no pipeline, sharded optimizer (torchtitan 2D).
        family(tps[:1], (1,), (1, 2), ("selective", "full"), (1, 3), True),
        # ZeRO-1 data parallel without sharded parameters (DDP + distributed optimizer).
        family((1,), (1,), (1, 2, 4), ("none", "selective", "full"), (1,), False),
    ]
    picked: list[Strategy] = []
    for members in families:
        if not members:
            continue
        reports = [cost_model.estimate(s, validate=False) for s in members]
        fitting = [s for s, r in zip(members, reports) if r.fits]
        choice = (
            fitting[0]
            if fitting
            else min(zip(members, reports), key=lambda sr: sr[1].peak_memory_bytes)[0]
        )
        if choice not in picked:
            picked.append(choice)
        if len(picked) >= limit:
            break
    return picked
