"""The rules a parallel layout must follow, each written once.

Every rule is a small function that returns ``None`` when the layout follows it, else one message
that says what is wrong and how to fix it. `Strategy.problems` composes all of them;
`search_spaces.SearchSpace` builds its tree with the same functions, so the space holds exactly
the strategies that `Strategy.validate` accepts (tests/test_search_spaces.py compares
`enumerate()` with a brute-force grid filtered by validation).

Sources: tensor parallel splits heads (Shoeybi et al. 2019, sec. 3); a pipeline needs at least
one micro-batch per stage to fill, and interleaved 1F1B needs pp * v to divide the layers and the
micro-batch count to be a multiple of pp (Narayanan et al. 2021, sec. 2.2); sequence parallel
splits the sequence over the tp group (Korthikanti et al. 2022, sec. 4.2.2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec

INTERLEAVED = "interleaved_1f1b"


def world_size_problem(
    dp: int, tp: int, pp: int, *, devices: int, cp: int = 1, where: str = ""
) -> str | None:
    if dp * tp * pp * cp == devices:
        return None
    if cp == 1:
        product = f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp}"
    else:
        product = f"dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} = {dp * tp * pp * cp}"
    return (
        f"{product} but the cluster has {devices} devices{where}; "
        f"choose degrees whose product is {devices}"
    )


def tp_problem(tp: int, model: ModelSpec) -> str | None:
    """tp splits the attention heads and the key/value heads."""
    if model.n_heads % tp:
        return (
            f"tp={tp} does not divide n_heads={model.n_heads}; use a tp that divides"
            f" {model.n_heads}"
        )
    if model.n_kv_heads % tp:
        return (
            f"tp={tp} does not divide n_kv_heads={model.n_kv_heads}; "
            f"use a tp that divides {model.n_kv_heads}"
        )
    mamba = model.mamba
    if mamba is not None and (mamba.n_heads % tp or mamba.n_groups % tp):
        # Megatron-Core MambaMixer splits the heads and the B / C groups over tp
        # (megatron/core/ssm/mamba_mixer.py: nheads_local_tp, ngroups_local_tp)
        return (
            f"tp={tp} does not divide the Mamba-2 mixer's {mamba.n_heads} heads and "
            f"{mamba.n_groups} groups; use a tp that divides "
            f"{math.gcd(mamba.n_heads, mamba.n_groups)}"
        )
    gdn = model.gdn
    if gdn is not None and (gdn.n_k_heads % tp or gdn.n_v_heads % tp):
        # Megatron-Core GatedDeltaNet splits the key and value heads over tp
        return (
            f"tp={tp} does not divide the Gated DeltaNet mixer's {gdn.n_k_heads} key heads and "
            f"{gdn.n_v_heads} value heads; use a tp that divides {gdn.n_k_heads}"
        )
    mamba1 = model.mamba1
    if mamba1 is not None and mamba1.d_inner % tp:
        # Mamba-1 splits its channels over tp (in_proj and dt_proj column-parallel, x_proj and
        # out_proj row-parallel: vLLM's MambaMixer, the tensor-parallel Mamba-1 there is)
        return (
            f"tp={tp} does not divide the Mamba-1 mixer's {mamba1.d_inner} channels; use a tp "
            f"that divides {mamba1.d_inner}"
        )
    return None


def layers_problem(
    pp: int, virtual_stages: int, model: ModelSpec, *, uneven: bool = False
) -> str | None:
    """The layers split into pp * virtual_stages equal chunks (or, `uneven`, chunks of at
    least one layer whose sizes differ by at most one: `split_layers`)."""
    chunks = pp * virtual_stages
    if model.n_layers % chunks == 0 or (uneven and model.n_layers >= chunks):
        return None
    if uneven:
        return (
            f"n_layers={model.n_layers} is fewer than pp*virtual_stages = {pp}*{virtual_stages} "
            f"= {chunks} pipeline chunks; every chunk needs at least one layer"
        )
    return (
        f"n_layers={model.n_layers} does not split into pp*virtual_stages = {pp}*{virtual_stages}"
        f" = {chunks} equal chunks; use pp*virtual_stages dividing {model.n_layers}, or give "
        "pipeline_split (layers per chunk)"
    )


def pipeline_split_problem(
    split: tuple[int, ...], pp: int, virtual_stages: int, n_layers: int | None
) -> str | None:
    """An explicit split names one layer count per chunk, covers every layer and gives every
    pipeline rank (chunks r, r + pp, ...) at least one; a chunk may be empty (0: the embedding,
    the loss or the MTP modules alone, as Megatron-Core's layouts put them)."""
    chunks = pp * virtual_stages
    if len(split) != chunks:
        return (
            f"pipeline_split has {len(split)} chunks but pp*virtual_stages = {chunks}; "
            f"give {chunks} layer counts"
        )
    if n_layers is not None and sum(split) != n_layers:
        return f"pipeline_split {list(split)} sums to {sum(split)} layers, not n_layers={n_layers}"
    idle = [r for r in range(pp) if not sum(split[r::pp])]
    if idle:
        return (
            f"pipeline_split {list(split)} gives pipeline rank {idle[0]} no layer (its chunks"
            f" are {list(range(idle[0], chunks, pp))}, chunk c runs on rank c mod pp={pp}); give"
            " every rank at least one layer, or use a smaller pp"
        )
    return None


def split_layers(n_layers: int, chunks: int) -> tuple[int, ...]:
    """Layers per pipeline chunk, as even as possible. With a remainder the middle chunks take
    the extra layers, since the first and last chunks also hold the embedding and the logits
    (torchtitan and Megatron-LM split Llama 3.1 405B's 126 layers over 8 stages as 15, 16 x 6,
    15; docs/runtimes.md)."""
    base, extra = divmod(n_layers, chunks)
    sizes = [base] * chunks
    order = sorted(range(chunks), key=lambda i: (abs(2 * i - (chunks - 1)), i))  # middle first
    for i in order[:extra]:
        sizes[i] += 1
    return tuple(sizes)


def balanced_split(
    weights: Sequence[float], chunks: int, *, first: float = 0.0, last: float = 0.0
) -> tuple[int, ...]:
    """Consecutive blocks of the given `weights` (seconds each) into `chunks` pipeline chunks of
    at least one block, the slowest chunk as fast as it can be; the first chunk also carries
    `first` (the embedding) and the last `last` (the logits and loss, the MTP modules).

    The bottleneck is found by bisection on it, each candidate checked greedily: a chunk takes
    blocks while it stays within the bottleneck (leaving one for each chunk after it), which
    is optimal for consecutive chunks (the linear partition problem; Bokhari 1988). Hand
    written: a dozen lines, where the libraries that balance pipeline stages (DeepSpeed's
    ``partition_balanced``, torchgpipe's ``balance_by_time``) come with their runtimes.

    Example:
        >>> balanced_split([1, 1, 1, 1, 2, 2, 2, 2], 2)
        (5, 3)
    """
    n = len(weights)
    if not 1 <= chunks <= n:
        raise ValueError(f"{n} blocks cannot fill {chunks} chunks of at least one block")

    def fill(bottleneck: float) -> tuple[int, ...] | None:
        sizes, i = [], 0
        for c in range(chunks):
            load = first if c == 0 else 0.0
            room = n - i - (chunks - c - 1)  # blocks this chunk may take
            take = 0
            while take < room and (take == 0 or load + weights[i + take] <= bottleneck):
                load += weights[i + take]
                take += 1
            if c == chunks - 1:
                if take < n - i or load + last > bottleneck:
                    return None
            elif load > bottleneck:
                return None
            sizes.append(take)
            i += take
        return tuple(sizes)

    low = max(max(weights), first + weights[0], last + weights[-1])
    high = first + last + sum(weights)
    best = fill(high)
    for _ in range(48):  # bisect to ~1e-14 of the total
        mid = (low + high) / 2
        sizes = fill(mid)
        if sizes is None:
            low = mid
        else:
            high, best = mid, sizes
    assert best is not None  # `high` always fits
    return best


def account_for_embedding_and_loss(n_layers: int, chunks: int) -> tuple[int, ...] | None:
    """Layers per pipeline chunk under Megatron-Core's --account-for-embedding-in-pipeline-split
    and --account-for-loss-in-pipeline-split: the embedding and the loss count as one layer
    each, n_layers + 2 split evenly, so the first and the last chunk hold one layer fewer (0:
    the embedding or the loss alone); None when n_layers + 2 does not divide (docs/runtimes.md
    3.4)."""
    per, rest = divmod(n_layers + 2, chunks)
    if rest or chunks < 2:
        return None
    return (per - 1,) + (per,) * (chunks - 2) + (per - 1,)


def context_parallel_problem(
    cp: int, seq_len: int | None, model: "ModelSpec | None" = None, tp: int = 1
) -> str | None:
    """Load-balanced ring attention cuts the sequence into 2 * cp pieces (torch's context
    parallel pairs piece i with piece 2cp-1-i, so causal work is even across ranks). Mamba-2
    layers under cp exchange their heads all-to-all (Megatron-Core
    megatron/core/ssm/mamba_context_parallel.py, MambaContextParallel): each cp rank takes
    whole heads of the tp rank's, so cp divides n_heads / tp, and whole groups (cp divides
    n_groups / tp) or a share of one group's heads (n_groups / tp divides cp)."""
    mamba = model.mamba if model is not None else None
    if cp > 1 and mamba is not None and not (mamba.n_heads % tp or mamba.n_groups % tp):
        heads, groups = mamba.n_heads // tp, mamba.n_groups // tp
        if heads % cp:
            return (
                f"cp={cp} does not divide the Mamba-2 mixer's {mamba.n_heads} heads / tp={tp} "
                f"= {heads} (Megatron-Core gives each cp rank whole heads); use a cp that "
                f"divides {heads}"
            )
        if (groups % cp) if groups >= cp else (cp % groups):
            return (
                f"cp={cp} and the Mamba-2 mixer's {mamba.n_groups} groups / tp={tp} = {groups}: "
                "one must divide the other (Megatron-Core gives each cp rank whole groups or a "
                f"share of one group's heads); use a cp that divides {groups} or a multiple of it"
            )
    if cp > 1 and model is not None and model.mamba1 is not None:
        return (
            f"cp={cp} with Mamba-1 layers is not priced (no runtime splits their selective "
            "scan over sequence shards); use cp=1"
        )
    if cp > 1 and model is not None and model.gdn is not None:
        return (
            f"cp={cp} with Gated DeltaNet layers is not priced (megatron-core 0.16 runs none: "
            "gated_delta_net.py leaves its GatedDeltaNetContextParallel commented out, and "
            "their chunk-wise state passing across ranks has no term); use cp=1"
        )
    if cp == 1 or seq_len is None or seq_len % (2 * cp) == 0:
        return None
    return f"cp={cp} needs seq_len={seq_len} divisible by 2*cp = {2 * cp} (load-balanced halves)"


def recompute_layers_problem(
    recompute: str, recompute_num_layers: int | None, smallest_chunk: int | None
) -> str | None:
    """Recomputing N layers per chunk is a form of full recompute, bounded by the chunk."""
    if recompute_num_layers is None:
        return None
    if recompute != "full":
        return (
            f"recompute_num_layers={recompute_num_layers} needs recompute=full (it chooses how "
            "many layers per pipeline chunk are recomputed whole)"
        )
    if smallest_chunk is not None and recompute_num_layers > smallest_chunk:
        return (
            f"recompute_num_layers={recompute_num_layers} exceeds the {smallest_chunk} layers of "
            "the smallest pipeline chunk; use at most that, or leave it unset for every layer"
        )
    return None


def fp8_problem(fp8: str, peak_flops: dict[str, float] | None) -> str | None:
    """Float8 matmuls need hardware with fp8 units (a profile with an fp8 peak)."""
    if fp8 == "none" or peak_flops is None or "fp8" in peak_flops:
        return None
    return (
        f"fp8={fp8} needs float8 matmul units, and this hardware profile has no fp8 peak "
        f"(it has {', '.join(peak_flops)}); set fp8=none or use a GPU with fp8 (H100, H200)"
    )


def expert_parallel_problem(
    ep: int, etp: int, dp: int, cp: int, tp: int, n_experts: int | None
) -> str | None:
    """Expert parallelism splits the routed experts over ep groups of etp ranks each, over the
    ranks attention runs tp x cp x dp on (Megatron-Core's parallel folding: expert layers run
    etp x ep x edp): etp divides tp, etp x ep divides tp x dp x cp, ep divides the experts.
    `n_experts` is None without a model, 0 for a dense model."""
    if ep == 1 and etp == 1:
        return None
    if n_experts == 0:
        return (
            f"ep={ep}, etp={etp} needs a mixture-of-experts model (this one is dense); set "
            "ep=1 and etp=1"
        )
    if tp % etp:
        return f"etp={etp} must divide tp={tp} (experts split over some of the tp ranks)"
    ranks = tp * dp * cp
    if ranks % (etp * ep):
        return (
            f"ep*etp = {ep}*{etp} must divide tp*dp*cp = {tp}*{dp}*{cp} = {ranks} (expert "
            "layers run etp x ep x edp over the ranks attention runs tp x dp x cp on); use an "
            "ep that divides it"
        )
    if n_experts is not None and n_experts % ep:
        return f"ep={ep} does not divide the {n_experts} routed experts; use an ep that does"
    return None


def recompute_modules_problem(modules: str, model: "ModelSpec | None") -> str | None:
    """Megatron-Core's per-module recompute names modules the model must have: moe_act, moe
    and shared_experts a mixture-of-experts layer (shared experts for the last), mla_up_proj
    multi-head latent attention, mlp a dense layer. Modelled for mixture-of-experts models
    only (a dense model has recompute=selective and full)."""
    if modules == "none" or model is None:
        return None
    if model.moe is None:
        return (
            f"recompute_modules={modules} is modelled for mixture-of-experts models only; for "
            f"the dense {model.name} use recompute=selective or full, or recompute_modules=none"
        )
    names = modules.split("+")
    lacking = []
    if "shared_experts" in names and not model.moe.n_shared_experts:
        lacking.append("shared_experts (it has no shared experts)")
    if "mla_up_proj" in names and model.mla is None:
        lacking.append("mla_up_proj (it has no multi-head latent attention)")
    if "mlp" in names and all(model.moe_layers):
        lacking.append("mlp (every layer is a MoE layer: no dense MLP)")
    if lacking:
        return (
            f"recompute_modules={modules} names modules {model.name} lacks: "
            f"{'; '.join(lacking)}; choose a set without them"
        )
    return None


def async_tp_problem(async_tp: bool, tp: int) -> str | None:
    if async_tp and tp == 1:
        return "async_tp overlaps tensor-parallel collectives: it needs tp > 1; turn it off"
    return None


def offload_problem(offload_params: bool, offload_optimizer: bool, zero_stage: int) -> str | None:
    """Parameters live on the host only as shards that each gather copies up (ZeRO-Infinity's
    offload_param needs stage 3; FSDP2's CPUOffloadPolicy shards them with fully_shard), and
    they are updated where they live: the optimizer state is on the host too (DeepSpeed
    pairs offload_param with offload_optimizer; FSDP2's policy runs the step on the CPU)."""
    if not offload_params:
        return None
    if zero_stage != 3:
        return (
            f"offload_params needs zero_stage=3 (the host holds parameter shards that each "
            f"gather copies up); got zero_stage={zero_stage}: set zero_stage=3 or "
            "offload_params=false"
        )
    if not offload_optimizer:
        return (
            "offload_params needs offload_optimizer=true (parameters on the host are updated "
            "there); set offload_optimizer=true"
        )
    return None


def batch_problem(global_batch_size: int, dp: int, micro_batch_size: int) -> str | None:
    """The global batch splits into dp ranks x whole micro-batches."""
    per_step = dp * micro_batch_size
    if global_batch_size % per_step == 0:
        return None
    return (
        f"global_batch_size={global_batch_size} does not split into dp*micro_batch_size ="
        f" {dp}*{micro_batch_size} = {per_step}; use a global batch that is a multiple of"
        f" {per_step}"
    )


def sequence_parallel_problem(sequence_parallel: bool, tp: int, seq_len: int | None) -> str | None:
    """Sequence parallel shards activations over tp > 1 ranks along the sequence."""
    if not sequence_parallel:
        return None
    if tp == 1:
        return (
            "sequence_parallel needs tp > 1 (it shards activations over the tp group); "
            "set tp > 1 or turn it off"
        )
    if seq_len is not None and seq_len % tp:
        return f"sequence_parallel with tp={tp} needs seq_len={seq_len} divisible by tp"
    return None


def schedule_problem(schedule: str, pp: int, virtual_stages: int) -> str | None:
    """Virtual stages exist only in the interleaved schedule, which needs a pipeline."""
    if virtual_stages > 1 and schedule != INTERLEAVED:
        return (
            f"virtual_stages={virtual_stages} needs pipeline_schedule interleaved_1f1b (got "
            f"{schedule}); set virtual_stages=1 or the interleaved schedule"
        )
    if schedule == INTERLEAVED and pp == 1:
        return "interleaved_1f1b needs pp > 1; use pipeline_schedule=1f1b with pp=1"
    if schedule == INTERLEAVED and virtual_stages == 1:
        return (
            "interleaved_1f1b needs virtual_stages > 1 (model chunks per pipeline rank); "
            "set virtual_stages or use 1f1b"
        )
    return None


def microbatch_problem(pp: int, n_microbatches: int, schedule: str) -> str | None:
    """A pipeline of pp stages needs >= pp micro-batches; interleaving a multiple of pp."""
    if pp == 1:
        return None
    if n_microbatches < pp:
        return (
            f"pipeline with pp={pp} needs at least {pp} micro-batches per step, got "
            f"{n_microbatches} (= global_batch_size / (dp*micro_batch_size)); raise the global "
            "batch or lower micro_batch_size"
        )
    if schedule == INTERLEAVED and n_microbatches % pp:
        return (
            f"interleaved_1f1b needs the micro-batch count {n_microbatches} to be a multiple of"
            f" pp={pp}"
        )
    return None


# ---- the rules of a whole strategy ------------------------------------------------------------
# Each rule of a strategy as `Strategy.problems` checks it, with the dimensions it reads, in the
# order its messages are reported. `values` maps dimension names to values (a Strategy's fields);
# `model` and `cluster` may be None (a user's own network; no cluster given): a rule that needs
# one is then skipped.


@dataclass(frozen=True)
class Rule:
    """A rule of a strategy: the dimensions it reads and its check (None when it holds)."""

    name: str
    reads: tuple[str, ...]
    check: Callable[[Mapping[str, Any], "ModelSpec | None", "Cluster | None"], str | None]


def _chunks(v: Mapping[str, Any], model: "ModelSpec | None") -> tuple[int, ...] | None:
    """Layers per pipeline chunk, when the split is valid (else None)."""
    if _layers(v, model) is not None or model is None:
        return None
    if v["pipeline_split"] is not None:
        return v["pipeline_split"]
    return split_layers(model.n_layers, v["pp"] * v["virtual_stages"])


def _layers(v: Mapping[str, Any], model: "ModelSpec | None") -> str | None:
    if v["pipeline_split"] is not None:
        n_layers = model.n_layers if model is not None else None
        return pipeline_split_problem(v["pipeline_split"], v["pp"], v["virtual_stages"], n_layers)
    if model is not None:
        return layers_problem(v["pp"], v["virtual_stages"], model, uneven=True)
    return None


def _world(v: Mapping[str, Any], _model, cluster: "Cluster | None") -> str | None:
    if cluster is None:
        return None
    where = f" ({cluster.n_nodes} nodes x {cluster.gpus_per_node})"
    return world_size_problem(
        v["dp"], v["tp"], v["pp"], cp=v["cp"], devices=cluster.world_size, where=where
    )


def _microbatches(v: Mapping[str, Any], _model, _cluster) -> str | None:
    # the micro-batch count is defined only when the batch splits
    if batch_problem(v["global_batch_size"], v["dp"], v["micro_batch_size"]) is not None:
        return None
    n_micro = v["global_batch_size"] // (v["dp"] * v["micro_batch_size"])
    return microbatch_problem(v["pp"], n_micro, v["pipeline_schedule"])


def _recompute_layers(v: Mapping[str, Any], model, _cluster) -> str | None:
    chunks = [c for c in _chunks(v, model) or () if c]  # an empty chunk recomputes nothing
    return recompute_layers_problem(
        v["recompute"], v["recompute_num_layers"], min(chunks) if chunks else None
    )


def _sequence_parallel(v: Mapping[str, Any], model, _cluster) -> str | None:
    seq_len = model.seq_len // v["cp"] if model is not None else None
    return sequence_parallel_problem(v["sequence_parallel"], v["tp"], seq_len)


RULES: tuple[Rule, ...] = (
    Rule("world_size", ("dp", "tp", "pp", "cp"), _world),
    Rule("tp", ("tp",), lambda v, m, c: tp_problem(v["tp"], m) if m is not None else None),
    Rule("layers", ("pp", "virtual_stages", "pipeline_split"), lambda v, m, c: _layers(v, m)),
    Rule(
        "batch",
        ("global_batch_size", "dp", "micro_batch_size"),
        lambda v, m, c: batch_problem(v["global_batch_size"], v["dp"], v["micro_batch_size"]),
    ),
    Rule("sequence_parallel", ("sequence_parallel", "tp", "cp"), _sequence_parallel),
    Rule(
        "context_parallel",
        ("cp", "tp"),
        lambda v, m, c: context_parallel_problem(
            v["cp"], m.seq_len if m is not None else None, m, v["tp"]
        ),
    ),
    Rule(
        "schedule",
        ("pipeline_schedule", "pp", "virtual_stages"),
        lambda v, m, c: schedule_problem(v["pipeline_schedule"], v["pp"], v["virtual_stages"]),
    ),
    Rule(
        "microbatches",
        ("global_batch_size", "dp", "micro_batch_size", "pp", "pipeline_schedule"),
        _microbatches,
    ),
    Rule(
        "recompute_layers",
        ("recompute", "recompute_num_layers", "pp", "virtual_stages", "pipeline_split"),
        _recompute_layers,
    ),
    Rule(
        "fp8",
        ("fp8",),
        lambda v, m, c: fp8_problem(v["fp8"], c.profile.peak_flops if c is not None else None),
    ),
    Rule("async_tp", ("async_tp", "tp"), lambda v, m, c: async_tp_problem(v["async_tp"], v["tp"])),
    Rule(
        "recompute_modules",
        ("recompute_modules",),
        lambda v, m, c: recompute_modules_problem(v["recompute_modules"], m),
    ),
    Rule(
        "offload",
        ("offload_params", "offload_optimizer", "zero_stage"),
        lambda v, m, c: offload_problem(
            v["offload_params"], v["offload_optimizer"], v["zero_stage"]
        ),
    ),
    Rule(
        "expert_parallel",
        ("ep", "etp", "dp", "cp", "tp"),
        lambda v, m, c: expert_parallel_problem(
            v["ep"], v["etp"], v["dp"], v["cp"], v["tp"], n_experts(m)
        ),
    ),
)


def n_experts(model: "ModelSpec | None") -> int | None:
    """Routed experts of `model` (0 for a dense model; None without a model)."""
    if model is None:
        return None
    return model.moe.n_experts if model.moe is not None else 0


def problems(
    values: Mapping[str, Any], model: "ModelSpec | None", cluster: "Cluster | None"
) -> list[str]:
    """Every rule `values` (a strategy's fields) breaks, in `RULES` order."""
    out = []
    for rule in RULES:
        message = rule.check(values, model, cluster)
        if message is not None:
            out.append(message)
    return out


def rules_reading(name: str) -> tuple[Rule, ...]:
    """The rules that read dimension `name`."""
    return tuple(rule for rule in RULES if name in rule.reads)
