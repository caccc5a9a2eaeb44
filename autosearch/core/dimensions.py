"""The dimensions of a parallel strategy, each declared once.

A dimension is one field of `Strategy`: a parallel degree (dp, tp, pp, cp), a size (micro-batch,
virtual stages), a choice among fixed values (pipeline schedule, recompute, ZeRO stage, amp,
fp8) or a flag (sequence parallel, compile, async TP). Its declaration here says what it is
(kind, legal values, default), where the search holds it (`level`), how a label shows it, what
a runtime must support to run it (`features`), and whether it is a parallel axis of the device
mesh. Everything that lists dimensions derives from `DIMENSIONS`:

- `Strategy`'s field defaults, its type checks (by kind) and its short label (`label`);
- the fields every strategy file holds (`FILE_FIELDS`);
- `RuntimeOptions.unsupported` (`features_used`);
- `SpaceConfig`'s keys and defaults (`space`) and the search tree's levels (`level`);
- the plain parameter names of a stored trial (`PLAIN_NAMES`);
- the parallel axes of the ranking's tie rule and of the error bands' kinds (`MESH_AXES`);
- the sweep's strategy columns and the dry run's layout listing.

The rules a strategy must follow are the functions of `autosearch.core.rules`; `rules.RULES`
says which dimensions each reads. This is torchtitan's single list of mesh axis names
(`ParallelDims`), widened to every dimension of a strategy.

Adding a dimension: one `Dimension` here, its typed field in `Strategy` (one line), its rule in
`rules.py`, the cost terms that read it, and its runtime mappings (exports, Engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy

# Kinds: how a value is checked and searched.
DEGREE = "degree"  # a parallel degree: an integer >= 1
SIZE = "size"  # an integer >= 1 that is not a degree (micro-batch, virtual stages)
BATCH = "batch"  # the global batch: an integer >= 1, or None for dp * micro_batch_size
CHOICE = "choice"  # one of `choices`
FLAG = "flag"  # true or false
COUNT = "count"  # an integer >= 1, or None (unset)
SPLIT = "split"  # a tuple of integers >= 1, or None

# Levels: where the search tree holds a dimension.
REST = "rest"  # a degree the others imply (dp = world / the product of the mesh levels)
MESH = "mesh"  # a degree level of the tree, in `depth` order
FOLDED = "folded"  # a degree over ranks the mesh degrees already count (`folds`), below them
LAYOUT = "layout"  # micro-batch and pipeline levels, below the degrees
AXIS = "axis"  # scanned inside a layout (a layout trial scores every combination)

ALL = None  # a space default: every value the model and cluster allow
NOT_SEARCHED = "not searched"  # a space default: not a key of the space


@dataclass(frozen=True)
class Feature:
    """A use of a dimension that a runtime must support to run it (the names of a runtime
    preset's ``supports``: `cost_models/runtimes.yaml`).

    Attributes:
        name: the name in ``supports`` (``cp``, ``selective_op`` ...).
        used: whether a value uses it.
        how: the value's use, as the refusal names it (``cp=4 (context parallel)``).
        of_strategy: `used` and `how` take the whole strategy, not the dimension's value (a
            use that depends on other degrees: ep groups over tensor-parallel ranks).
        of_model: `used` and `how` take the value and the ModelSpec (a use that depends on
            the model: LoRA adapters under tensor parallelism); not checked where no model is
            known.
    """

    name: str
    used: Callable[..., bool]
    how: Callable[..., str]
    of_strategy: bool = False
    of_model: bool = False


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """One dimension of a strategy.

    Attributes:
        name: the Strategy field.
        kind: `DEGREE`, `SIZE`, `BATCH`, `CHOICE`, `FLAG`, `COUNT` or `SPLIT`.
        default: the value when a strategy does not name it.
        doc: one line for help texts.
        choices: the legal values of a `CHOICE` or `FLAG`, in their canonical order.
        level: where the search tree holds it (`REST`, `MESH`, `FOLDED`, `LAYOUT`, `AXIS`), or
            None.
        depth: the order of `MESH` and `FOLDED` levels from the root (the folded ones below).
        folds: for a `FOLDED` degree, the mesh degrees whose ranks it splits (it divides their
            product and adds no devices: Megatron-Core's parallel folding).
        space: the search space's default (`ALL`, a tuple of values, or `NOT_SEARCHED`).
        file: a strategy file written by autosearch always holds it (a file that lacks one is
            cut short).
        plain: the name it is stored under in a trial (None: not stored on its own; the
            schedule and virtual stages are stored together as ``pipeline``).
        label: its part of `Strategy.short`, or None when it shows nothing.
        label_rank: the position of that part (smaller first).
        features: the uses a runtime must support.
        mesh_axis: a degree of the device mesh: the mesh degrees multiply to the world size.
        exports: {runtime: its key} where another runtime takes the value as it is (a Megatron-LM
            flag, a torchtitan ``section.key``): the exporters write it when it is not the
            default (`autosearch.export`).
        no_export: {runtime: why} where a runtime cannot express a value other than the default.
    """

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple[Any, ...] = ()
    level: str | None = None
    depth: int = 0
    folds: tuple[str, ...] = ()
    space: Any = NOT_SEARCHED
    file: bool = False
    plain: str | None = None
    label: Callable[[Any], str | None] | None = None  # of a Strategy, or a Layout
    label_rank: int = 0
    features: tuple[Feature, ...] = ()
    mesh_axis: bool = False
    exports: Mapping[str, str] = dataclasses.field(default_factory=dict)
    no_export: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def searched(self) -> bool:
        return self.space is not NOT_SEARCHED


def _degree_label(name: str, *, always: bool = False) -> Callable[[Any], str | None]:
    """``tp8``; a degree that is not `always` shown only when above 1."""
    if always:
        return lambda s: f"{name}{getattr(s, name)}"
    return lambda s: f"{name}{getattr(s, name)}" if getattr(s, name) > 1 else None


def _pipeline_label(s: "Strategy") -> str | None:
    if s.pp == 1:
        return None
    return s.pipeline_schedule + (f"v{s.virtual_stages}" if s.virtual_stages > 1 else "")


def _recompute_label(s: "Strategy") -> str | None:
    if s.recompute == "none":
        return None
    return f"rc-{s.recompute}{s.recompute_num_layers or ''}"


# Megatron-Core's per-module recompute (`TransformerConfig.recompute_modules`, with
# --recompute-granularity selective), beyond its attention core (core_attn, which is
# recompute=selective here): the module sets the published MoE recipes run, each written in
# Megatron's module names joined by "+" (megatron-core 0.16 transformer_config.py; recipes in
# docs/runtimes.md [3.10]). layernorm, moe_act and mla_up_proj discard their outputs and
# recompute them in backward; mlp (the dense layers' MLP), shared_experts and moe (the whole MoE
# layer) keep only their inputs.
RECOMPUTE_MODULE_SETS = (
    "none",
    "layernorm+moe_act",  # Megatron-MoE model zoo "norm, act"
    "layernorm+moe_act+shared_experts",  # model zoo Qwen3-Next "norm, act, shared_expert"
    "layernorm+moe",  # model zoo long-context Qwen3-235B command lines
    "mla_up_proj",  # Megatron-Bridge DeepSeek-V3 / Kimi-K2 Blackwell recipes
    "layernorm+mla_up_proj",  # Megatron-Bridge deepseek_v3 recipe default
    "mla_up_proj+mlp",  # Megatron-Bridge DeepSeek-V3 H100 recipe
    "mlp+moe_act",  # Megatron-Bridge DeepSeek-V3 (up_proj recompute removed)
    "mla_up_proj+mlp+moe_act",  # Megatron-Bridge 25.09 DeepSeek-V3 GB200 (run_script.py)
)


def _recompute_modules_label(s: "Strategy") -> str | None:
    return None if s.recompute_modules == "none" else f"rcm-{s.recompute_modules}"


def _flag_label(name: str, text: str) -> Callable[["Strategy"], str | None]:
    return lambda s: text if getattr(s, name) else None


# The registry, in the order of a stored trial's parameters (dp, tp, pp, cp, micro-batch,
# pipeline, recompute ...). Strategy declares its typed fields in file order; `_check` ties the
# two at import.
DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(
        name="dp",
        kind=DEGREE,
        default=1,
        doc="data-parallel degree (replicas, or shards with ZeRO)",
        level=REST,
        space=ALL,
        file=True,
        plain="dp",
        label=_degree_label("dp", always=True),
        label_rank=0,
        mesh_axis=True,
    ),
    Dimension(
        name="tp",
        kind=DEGREE,
        default=1,
        doc="tensor-parallel degree (Megatron-style column/row split of every block)",
        level=MESH,
        depth=0,
        space=ALL,
        file=True,
        plain="tp",
        label=_degree_label("tp", always=True),
        label_rank=10,
        # LoRA adapters on tensor-parallel linears: Megatron-Bridge's LoRA shards them as their
        # base layers; the Engine's peft layers wrap the nn.Linear its tp plan shards.
        features=(
            Feature(
                "lora_tp",
                lambda v, model: v > 1 and model.lora is not None,
                lambda v, model: f"tp={v} with LoRA adapters",
                of_model=True,
            ),
        ),
        mesh_axis=True,
    ),
    Dimension(
        name="pp",
        kind=DEGREE,
        default=1,
        doc="pipeline-parallel degree (stages)",
        level=MESH,
        depth=2,
        space=ALL,
        file=True,
        plain="pp",
        label=_degree_label("pp", always=True),
        label_rank=20,
        mesh_axis=True,
    ),
    Dimension(
        name="cp",
        kind=DEGREE,
        default=1,
        doc="context-parallel degree (the sequence split over cp ranks, ring attention)",
        level=MESH,
        depth=1,
        space=(1,),
        plain="cp",
        label=_degree_label("cp"),
        label_rank=30,
        features=(
            Feature("cp", lambda v: v > 1, lambda v: f"cp={v} (context parallel)"),
            # Mamba-2 layers under cp: Megatron-Core's head-wise all-to-all
            # (megatron/core/ssm/mamba_context_parallel.py), not ring attention
            Feature(
                "mamba_cp",
                lambda v, model: v > 1 and model.mamba is not None,
                lambda v, model: f"cp={v} with Mamba-2 layers (head-wise all-to-all)",
                of_model=True,
            ),
        ),
        mesh_axis=True,
    ),
    Dimension(
        name="ep",
        kind=DEGREE,
        default=1,
        # Expert layers run over the data- and context-parallel ranks of attention, split into
        # ep groups that each hold n_experts / ep experts (Megatron-Core's parallel folding:
        # attention uses tp x cp x dp, experts etp x ep x edp over the same ranks; torchtitan
        # borrows its EP ranks from dp_shard x cp the same way). It adds no devices.
        doc="expert-parallel degree (the routed experts split over ep groups of the "
        "tp x dp x cp ranks, each etp wide)",
        level=FOLDED,
        depth=0,
        folds=("dp", "cp", "tp"),
        space=ALL,
        plain="ep",
        label=_degree_label("ep"),
        label_rank=35,
        features=(
            Feature("ep", lambda v: v > 1, lambda v: f"ep={v} (expert parallel)"),
            Feature(
                "ep_over_tp",
                lambda s: s.ep > 1 and (s.dp * s.cp) % s.ep != 0,
                lambda s: (
                    f"ep={s.ep} over tensor-parallel ranks (ep does not divide dp x cp = "
                    f"{s.dp * s.cp})"
                ),
                of_strategy=True,
            ),
        ),
        exports={
            "megatron": "--expert-model-parallel-size",
            "torchtitan": "parallelism.expert_parallel_degree",
        },
        no_export={
            "deepspeed": "expert parallelism is set in the model "
            "(deepspeed.moe.layer.MoE(ep_size=...)), not in the config",
        },
    ),
    Dimension(
        name="etp",
        kind=DEGREE,
        default=1,
        # Expert tensor parallel: each expert's matrices split over etp of the tp ranks
        # (Megatron-Core --expert-tensor-parallel-size; torchtitan expert_tensor_parallel_degree,
        # 1 or tp). etp x ep x edp = tp x dp x cp: with etp < tp an ep group takes ranks that
        # attention splits by tp (parallel folding, Liu et al. 2025, "MoE Parallel Folding").
        doc="expert-tensor-parallel degree (each expert's matrices split over etp of the tp "
        "ranks)",
        level=FOLDED,
        depth=1,
        folds=("tp",),
        space=ALL,
        plain="etp",
        label=_degree_label("etp"),
        label_rank=36,
        features=(
            Feature("etp", lambda v: v > 1, lambda v: f"etp={v} (expert tensor parallel)"),
            Feature(
                "etp_below_tp",
                lambda s: 1 < s.etp < s.tp,
                lambda s: f"etp={s.etp} below tp={s.tp} (experts split over some tp ranks)",
                of_strategy=True,
            ),
        ),
        exports={
            "megatron": "--expert-tensor-parallel-size",
            "torchtitan": "parallelism.expert_tensor_parallel_degree",
        },
        no_export={
            "deepspeed": "expert tensor parallelism is not a DeepSpeed config setting",
        },
    ),
    Dimension(
        name="micro_batch_size",
        kind=SIZE,
        default=1,
        doc="sequences per micro-batch on one data-parallel rank",
        level=LAYOUT,
        space=ALL,
        file=True,
        plain="micro_batch_size",
        label=lambda s: f"mb{s.micro_batch_size}",
        label_rank=40,
    ),
    Dimension(
        name="global_batch_size",
        kind=BATCH,
        default=None,
        doc="sequences per optimizer step over the whole cluster (the study's, not searched)",
        file=True,
        label=lambda s: f"gbs{s.global_batch_size}",
        label_rank=50,
    ),
    Dimension(
        name="pipeline_schedule",
        kind=CHOICE,
        default="1f1b",
        doc="pipeline schedule (Narayanan et al. 2021)",
        choices=("gpipe", "1f1b", "interleaved_1f1b"),
        level=LAYOUT,
        space=("gpipe", "1f1b", "interleaved_1f1b"),
        file=True,
        plain="pipeline",
        label=_pipeline_label,
        label_rank=60,
        features=(
            # Megatron-Core's MambaModel refuses virtual pipeline stages (megatron-core 0.16
            # megatron/core/ssm/mamba_block.py, MambaStack._select_layers_for_pipeline_parallel:
            # "The Mamba hybrid model does not currently support virtual/interleaved pipeline
            # parallelism")
            Feature(
                "mamba_interleaved_pp",
                lambda v, model: v == "interleaved_1f1b" and model.mamba is not None,
                lambda v, model: "interleaved_1f1b with Mamba-2 layers",
                of_model=True,
            ),
        ),
    ),
    Dimension(
        name="virtual_stages",
        kind=SIZE,
        default=1,
        doc="model chunks per pipeline rank (> 1 only with interleaved_1f1b)",
        level=LAYOUT,
        space=ALL,
        file=True,
        plain="pipeline",
    ),
    Dimension(
        name="recompute",
        kind=CHOICE,
        default="none",
        # selective = the attention core (Korthikanti et al. 2022, sec. 5); selective_op = save
        # the matmul outputs, recompute the rest (torchtitan's op-level AC); full = each layer's
        # whole forward (Chen et al. 2016), on every layer or on `recompute_num_layers`.
        doc="activation recompute: none, selective (attention core), selective_op, full",
        choices=("none", "selective", "selective_op", "full"),
        level=AXIS,
        space=("none", "selective", "selective_op", "full"),
        file=True,
        plain="recompute",
        label=_recompute_label,
        label_rank=70,
        features=(
            Feature(
                "selective_op", lambda v: v == "selective_op", lambda v: "recompute=selective_op"
            ),
        ),
    ),
    Dimension(
        name="recompute_modules",
        kind=CHOICE,
        default="none",
        doc="Megatron-Core per-module recompute beyond the attention core (its "
        "--recompute-modules): " + ", ".join(RECOMPUTE_MODULE_SETS[1:]),
        choices=RECOMPUTE_MODULE_SETS,
        level=AXIS,
        space=("none",),
        plain="recompute_modules",
        label=_recompute_modules_label,
        label_rank=75,
        features=(
            Feature(
                "recompute_modules",
                lambda v: v != "none",
                lambda v: f"recompute_modules={v} (Megatron-Core per-module recompute)",
            ),
        ),
        no_export={
            "torchtitan": "torchtitan checkpoints whole blocks or ops, not Megatron's modules",
            "deepspeed": "DeepSpeed's activation checkpointing is set in the model, per layer",
        },
    ),
    Dimension(
        name="recompute_num_layers",
        kind=COUNT,
        default=None,
        doc="with recompute=full, recompute this many layers of each pipeline chunk",
        plain="recompute_num_layers",
        features=(
            Feature(
                "recompute_num_layers",
                lambda v: v is not None,
                lambda v: f"recompute_num_layers={v}",
            ),
        ),
    ),
    Dimension(
        name="pipeline_split",
        kind=SPLIT,
        default=None,
        doc="layers of each pipeline chunk, in order (None: as even as possible)",
        plain="pipeline_split",
        label=lambda s: (
            None if s.pipeline_split is None else "split" + "_".join(map(str, s.pipeline_split))
        ),
        label_rank=100,
        features=(
            Feature("uneven_pp", lambda v: v is not None, lambda v: "pipeline_split"),
            # MambaModel places its layers evenly over pp, or takes only the first and last
            # stages' counts (megatron-core 0.16 MambaStack._select_layers_for_pipeline_parallel)
            Feature(
                "mamba_uneven_pp",
                lambda v, model: v is not None and model.mamba is not None,
                lambda v, model: "pipeline_split with Mamba-2 layers",
                of_model=True,
            ),
        ),
    ),
    Dimension(
        name="sequence_parallel",
        kind=FLAG,
        default=False,
        doc="shard norm and dropout activations over tp (Korthikanti et al. 2022)",
        choices=(False, True),
        level=AXIS,
        space=(False, True),
        file=True,
        plain="sequence_parallel",
        label=_flag_label("sequence_parallel", "sp"),
        label_rank=80,
    ),
    Dimension(
        name="zero_stage",
        kind=CHOICE,
        default=0,
        doc="ZeRO sharding over dp: 1 optimizer states, 2 + gradients, 3 + parameters",
        choices=(0, 1, 2, 3),
        level=AXIS,
        space=(0, 1, 2, 3),
        file=True,
        plain="zero_stage",
        label=lambda s: f"z{s.zero_stage}" if s.zero_stage else None,
        label_rank=90,
    ),
    Dimension(
        name="amp",
        kind=CHOICE,
        default="bf16",
        doc="compute precision",
        choices=("fp32", "fp16", "bf16"),
        level=AXIS,
        space=("fp32", "fp16", "bf16"),
        file=True,
        plain="amp",
        label=lambda s: s.amp,
        label_rank=110,
    ),
    Dimension(
        name="fp8",
        kind=CHOICE,
        default="none",
        # Float8 linears with a scale per tensor (torchao tensorwise; TransformerEngine delayed
        # and current scaling are per-tensor scales too) or per row (torchao rowwise).
        doc="float8 matmuls in the blocks (needs a GPU with fp8 units)",
        choices=("none", "tensorwise", "rowwise"),
        level=AXIS,
        space=("none",),
        plain="fp8",
        label=lambda s: f"fp8{s.fp8}" if s.fp8 != "none" else None,
        label_rank=120,
        features=(Feature("fp8", lambda v: v != "none", lambda v: f"fp8={v}"),),
    ),
    Dimension(
        name="compile",
        kind=FLAG,
        default=False,
        doc="the runtime compiles each block (torch.compile): elementwise work fuses",
        choices=(False, True),
        level=AXIS,
        space=(False,),
        plain="compile",
        label=_flag_label("compile", "compile"),
        label_rank=130,
        features=(Feature("compile", bool, lambda v: "compile=true"),),
    ),
    Dimension(
        name="async_tp",
        kind=FLAG,
        default=False,
        doc="tensor-parallel collectives overlap the matmuls (micro-pipelined TP)",
        choices=(False, True),
        level=AXIS,
        space=(False,),
        plain="async_tp",
        label=_flag_label("async_tp", "asynctp"),
        label_rank=140,
        features=(Feature("async_tp", bool, lambda v: "async_tp=true"),),
    ),
    # Offload to host memory (issue 36). Searched only where nothing fits without it: the
    # default space resolves them to off unless the memory floor, or a scan of the space's
    # leanest strategies, proves the device too small (`SpaceConfig.resolved(offload=...)`, as
    # autosearch/tuning/_advice.py `offload_needed` asks).
    Dimension(
        name="offload_optimizer",
        kind=FLAG,
        default=False,
        # ZeRO-Offload (Ren et al. 2021): the fp32 master weights and Adam moments live on the
        # host, gradients go down to it and the updated parameters come back; the optimizer
        # step runs on the host's cores (DeepSpeed CPU-Adam, torchao CPUOffloadOptimizer,
        # Megatron-Core --optimizer-cpu-offload).
        doc="optimizer states and the optimizer step on the host (ZeRO-Offload)",
        choices=(False, True),
        level=AXIS,
        space=(False,),
        plain="offload_optimizer",
        label=_flag_label("offload_optimizer", "offopt"),
        label_rank=150,
        features=(Feature("offload_optimizer", bool, lambda v: "offload_optimizer=true"),),
    ),
    Dimension(
        name="offload_params",
        kind=FLAG,
        default=False,
        # ZeRO-Infinity (Rajbhandari et al. 2021) / FSDP2 CPUOffloadPolicy: the sharded
        # parameters (and their gradients) live on the host; each gather copies the shard up.
        doc="sharded parameters on the host, copied up for each gather (ZeRO-3 / FSDP only)",
        choices=(False, True),
        level=AXIS,
        space=(False,),
        plain="offload_params",
        label=_flag_label("offload_params", "offparam"),
        label_rank=151,
        features=(Feature("offload_params", bool, lambda v: "offload_params=true"),),
        no_export={
            "megatron": "Megatron-Core has no parameter offload to host memory",
        },
    ),
    Dimension(
        name="offload_activations",
        kind=CHOICE,
        default="none",
        # layers: every tensor a layer saves for backward goes to the host in forward and
        # comes back in backward (autograd's saved-tensor hooks: torch.autograd.graph.
        # save_on_cpu; Megatron-Core --cpu-offloading over all layers).
        doc="activation offload: none, or layers (every layer's saved tensors on the host)",
        choices=("none", "layers"),
        level=AXIS,
        space=("none",),
        plain="offload_activations",
        label=lambda s: (
            None if s.offload_activations == "none" else f"offact-{s.offload_activations}"
        ),
        label_rank=152,
        features=(
            Feature(
                "offload_activations",
                lambda v: v != "none",
                lambda v: f"offload_activations={v}",
            ),
        ),
        no_export={
            "torchtitan": "torchtitan has no activation offload to host memory",
            "deepspeed": "DeepSpeed offloads only the checkpointed layer inputs "
            "(activation_checkpointing.cpu_checkpointing), not every saved tensor",
        },
    ),
)

BY_NAME: dict[str, Dimension] = {d.name: d for d in DIMENSIONS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
# The degrees of the device mesh, in registry order (dp, tp, pp, cp): their product is the
# world size.
MESH_AXES: tuple[str, ...] = tuple(d.name for d in DIMENSIONS if d.mesh_axis)
# Every parallel degree, folded ones included: those above 1 are a strategy's parallel axes.
DEGREES: tuple[str, ...] = tuple(d.name for d in DIMENSIONS if d.kind == DEGREE)
# The folded degree levels of the search tree, below the mesh levels.
FOLDED_LEVELS: tuple[str, ...] = tuple(
    d.name for d in sorted((d for d in DIMENSIONS if d.level == FOLDED), key=lambda d: d.depth)
)
# The degree levels of the search tree from the root (tp, cp, pp); dp is what they leave.
MESH_LEVELS: tuple[str, ...] = tuple(
    d.name for d in sorted((d for d in DIMENSIONS if d.level == MESH), key=lambda d: d.depth)
)
# Scanned inside a layout, in scan (and sampling) order.
AXES: tuple[str, ...] = tuple(d.name for d in DIMENSIONS if d.level == AXIS)
# The plain parameter names of a stored trial, in order (the schedule and its virtual stages
# are one, ``pipeline``).
PLAIN_NAMES: tuple[str, ...] = tuple(dict.fromkeys(d.plain for d in DIMENSIONS if d.plain))
LABEL_ORDER: tuple[Dimension, ...] = tuple(
    sorted((d for d in DIMENSIONS if d.label is not None), key=lambda d: d.label_rank)
)
FEATURES: tuple[tuple[str, Feature], ...] = tuple(
    (d.name, f) for d in DIMENSIONS for f in d.features
)


def field(name: str) -> Any:
    """The dataclass field of dimension `name` in `Strategy` (its default from here)."""
    return dataclasses.field(default=BY_NAME[name].default)


def short_label(strategy: "Strategy") -> str:
    """``dp8-tp8-pp4-mb2-gbs512-1f1b-rc-full-sp-z1-bf16``: every dimension's label part."""
    return join_labels(strategy, LABEL_ORDER)


def join_labels(obj: Any, dims: tuple[Dimension, ...]) -> str:
    """The label parts of `dims` for `obj` (a Strategy, or anything with their attributes)."""
    parts = []
    for d in dims:
        part = d.label(obj) if d.label is not None else None
        if part:
            parts.append(part)
    return "-".join(parts)


def features_used(strategy: "Strategy", model: "ModelSpec | None" = None) -> dict[str, str]:
    """{feature: how} for each runtime feature the strategy uses (`RuntimeOptions.supports`),
    on `model` where it is given (features `of_model` are checked only then)."""
    out = {}
    for name, feature in FEATURES:
        args: tuple[Any, ...] = (strategy if feature.of_strategy else getattr(strategy, name),)
        if feature.of_model:
            if model is None:
                continue
            args += (model,)
        if feature.used(*args):
            out[feature.name] = feature.how(*args)
    return out


def feature_names() -> tuple[str, ...]:
    """Every name a runtime's ``supports`` may list."""
    return tuple(f.name for _, f in FEATURES)


def parallel_axes(strategy: "Strategy") -> tuple[str, ...]:
    """The parallel degrees of `strategy` above 1, folded ones included (``("dp", "tp")``)."""
    return tuple(name for name in DEGREES if getattr(strategy, name) > 1)


def check_fields(cls: type) -> None:
    """Raise if the dataclass `cls` (Strategy) does not declare exactly the registry's
    dimensions with their defaults: a dimension added in one place only fails at import."""
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    missing = [n for n in NAMES if n not in fields]
    extra = [n for n in fields if n not in BY_NAME]
    wrong = [n for n in NAMES if n in fields and fields[n] != BY_NAME[n].default]
    if missing or extra or wrong:
        raise TypeError(
            f"{cls.__name__} and autosearch/core/dimensions.py disagree: missing {missing}, "
            f"undeclared {extra}, other defaults {wrong}"
        )
