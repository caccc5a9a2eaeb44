"""Build the model the Engine runs: from an instance or a factory, on the meta device or not,
wrapped when it is a known transformers model; check a strategy against it; allocate and
initialise meta-device parts once parallelized."""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.core.runtime import engine_lacks
from autosearch.distributed.plan import ParallelPlan
from autosearch.models.moe import ep_problems

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.strategy import Strategy


def is_module(obj) -> bool:
    return isinstance(obj, nn.Module)


def wrap_known(model: nn.Module) -> nn.Module:
    """A transformers causal LM of a family the Engine trains wrapped in its family's wrapper
    (`autosearch.models.hf.families`: its plan, ModelSpec and parameter names); any other
    module as it is."""
    if type(model).__module__.startswith("transformers."):
        from autosearch.models.hf.families import wrapper_class

        wrapper = wrapper_class(model)
        if wrapper is not None:
            return wrapper(model)
        if hasattr(getattr(model, "config", None), "model_type"):  # a transformers model
            refuse_hf_family(model)
    return model


def refuse_hf_family(model: nn.Module) -> None:
    """Refuse a transformers model the Engine does not wrap, naming the families it runs (its
    outputs are a ModelOutput, which the loss would fail on deep inside a step)."""
    from autosearch.models.hf.families import FAMILIES

    runs = sorted(FAMILIES)
    model_type = getattr(model.config, "model_type", None)
    raise SpecError(
        f"the Engine does not run transformers' {type(model).__name__} (model_type "
        f"{model_type!r}): it wraps the causal LMs (*ForCausalLM, GPT2LMHeadModel, ...) of "
        f"model_type {', '.join(runs)}. Load one of those, or wrap the model in an nn.Module "
        "of your own whose forward returns the logits tensor"
    )


def build_model(source, *, meta_init: bool, seed: int | None, instance_used: bool) -> nn.Module:
    """The module to parallelize, from `source` (an ``nn.Module`` or a zero-argument factory).

    With `meta_init` the factory runs under ``torch.device("meta")``: parameters have shapes but
    no memory until `materialize`. An instance can be parallelized only once (`instance_used`).
    """
    if meta_init:
        if is_module(source) or not callable(source):
            raise SpecError(
                "meta_init=True needs a zero-argument model factory (the engine builds it on the "
                "meta device), e.g. Engine(lambda: Transformer(spec), meta_init=True)"
            )
        with torch.device("meta"):
            model = source()
    elif is_module(source):
        if instance_used:
            raise SpecError(
                "the model instance was already parallelized for another strategy; pass a "
                "zero-argument factory (e.g. lambda: Transformer(spec)) so the engine can "
                "rebuild it"
            )
        model = source
    elif callable(source):
        if seed is not None:
            torch.manual_seed(seed)
        model = source()
    else:
        raise SpecError(
            f"model must be an nn.Module or a zero-argument factory, got {type(source).__name__}"
        )
    if not is_module(model):
        raise SpecError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    return wrap_known(model)


def plan_for(model: nn.Module, plan: ParallelPlan | None) -> ParallelPlan:
    """The plan given to the Engine, else the model's ``parallel_plan()``, else an empty plan."""
    if plan is not None:
        return plan
    make_plan = getattr(model, "parallel_plan", None)
    if callable(make_plan):
        return make_plan()
    return ParallelPlan()


def strategy_problems(
    strategy: "Strategy", plan: ParallelPlan, model: nn.Module, *, device: str = "cpu"
) -> list[str]:
    """Why `strategy` cannot run `model` with `plan` on `device` (``cpu``, ``cuda:9.0``; empty
    when it can). Checked on every rank before anything is built, so nothing is half-applied."""
    from autosearch.engine.parallelize import blocks_of

    # The model's own check covers the Strategy rules; without one, those not needing the model.
    problems = list(plan.check(strategy)) if plan.check is not None else strategy.problems(None)
    if strategy.tp > 1 and plan.tp_plan is None:
        problems.append(
            f"tp={strategy.tp} needs a tensor-parallel plan and this model has none; pass "
            "Engine(..., plan=ParallelPlan(tp_plan=...)) or use tp=1 "
            "(dp, zero, recompute, amp work)"
        )
    if strategy.pp > 1:
        container = blocks_of(model, plan)
        if not isinstance(container, nn.ModuleDict):
            problems.append(
                f"pp={strategy.pp} needs the model's blocks in an nn.ModuleDict named by "
                f"ParallelPlan.blocks ({plan.blocks!r} here) and a forward that skips None "
                "modules; "
                "pass a ParallelPlan or use pp=1"
            )
        else:
            from autosearch.engine.pipeline import pipeline_bounds

            bounds = pipeline_bounds(plan, strategy, len(container))
            if isinstance(bounds, str) and not problems:  # else the model's check said why
                problems.append(f"the pipeline split is impossible: {bounds}")
    problems += engine_lacks(strategy, device)
    problems += ep_problems(strategy, model)
    has_blocks = blocks_of(model, plan) is not None
    for what, used in (
        ("compile=true", strategy.compile),
        (f"fp8={strategy.fp8}", strategy.fp8 != "none"),
        ("recompute=selective_op", strategy.recompute == "selective_op"),
        (f"recompute_num_layers={strategy.recompute_num_layers}", strategy.recompute_num_layers),
        (
            f"offload_activations={strategy.offload_activations}",
            strategy.offload_activations != "none",
        ),
    ):
        if used and not has_blocks:
            problems.append(
                f"{what} works block by block and this model has no blocks where "
                f"ParallelPlan.blocks says ({plan.blocks!r}); pass a ParallelPlan naming them or "
                "leave it out"
            )
    if strategy.async_tp and not strategy.compile:
        problems.append(
            "async_tp=true is Inductor's micro-pipelined TP pass, which rewrites compiled graphs:"
            " it needs compile=true (as torchtitan requires); set compile=true or async_tp=false"
        )
    if strategy.fp8 != "none" and importlib.util.find_spec("torchao") is None:
        problems.append(
            f"fp8={strategy.fp8} runs torchao's float8 linears and torchao is not installed: "
            "pip install 'autosearch[fp8]' (torchao 0.18), or set fp8=none"
        )
    problems += offload_problems(strategy, device)
    if strategy.cp > 1 and not any(hasattr(type(m), "context_parallel") for m in model.modules()):
        problems.append(
            f"cp={strategy.cp} needs a model whose attention attends over the whole sequence "
            "from a shard of it (a `context_parallel` attribute on its attention core, as "
            "autosearch.models.transformer and the Hugging Face families have); use cp=1"
        )
    if strategy.recompute == "selective" and (
        plan.attention_core is None or blocks_of(model, plan) is None
    ):
        problems.append(
            "recompute=selective needs ParallelPlan(attention_core=...) naming the attention "
            "core of "
            "each block; use recompute=full or give the plan"
        )
    return problems


def offload_problems(strategy: "Strategy", device: str) -> list[str]:
    """Why the Engine cannot offload as `strategy` asks on `device` (``cpu``, ``cuda:9.0``)."""
    from autosearch.core.dp_modes import dp_mode

    s, out = strategy, []
    mode = dp_mode(zero_stage=s.zero_stage, dp=s.dp * s.cp, tp=s.tp, pp=s.pp, ep=s.ep)
    if s.offload_params and mode.wrapper != "fsdp":
        out.append(
            "offload_params runs through FSDP2's CPUOffloadPolicy, and at dp x cp = "
            f"{s.dp * s.cp} the Engine applies no FSDP2 (autosearch/core/dp_modes.py); use "
            "dp x cp > 1 or offload_params=false"
        )
    own_optimizer = s.offload_optimizer and not s.offload_params and device != "cpu"
    if own_optimizer and importlib.util.find_spec("torchao") is None:
        out.append(
            "offload_optimizer without offload_params steps torchao's CPUOffloadOptimizer and "
            "torchao is not installed: pip install 'autosearch[fp8]' (torchao 0.18), or "
            "offload the parameters too (FSDP2's CPUOffloadPolicy steps the optimizer on the "
            "CPU)"
        )
    if own_optimizer and mode.zero_redundancy_optimizer:
        out.append(
            "offload_optimizer under ZeRO-1 with DDP (ZeroRedundancyOptimizer) has no host "
            "optimizer in the Engine; use zero_stage 2 or 3"
        )
    return out


# Why a device cannot run a dimension the Engine runs elsewhere (the `torch` preset's `devices`).
def device_label(device: torch.device) -> str:
    """``cpu``, or ``cuda:9.0`` (the device type and its compute capability)."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda:{major}.{minor}"


def materialize(part: nn.Module, *, device: torch.device, seed: int) -> None:
    """Allocate a meta-device part on `device` (this rank's shards only) and initialise it with
    its ``init_weights()``, else each submodule's ``reset_parameters()``, seeded by `seed`.
    Normal draws into DTensor shards on a mesh without DTensor's random-number tracker take
    their window of the whole weight's draw (`WholeWeightNormal`)."""
    from autosearch.engine.parallelize import tied_parameters

    tied = tied_parameters(part)
    part.to_empty(device=device)
    # to_empty from the meta device gives each name of a tied plain parameter a tensor of its
    # own (DTensors keep theirs): tie them again, else one process trains them untied
    for group in tied:
        first = part.get_parameter(group[0])
        for name in group[1:]:
            if part.get_parameter(name) is not first:
                owner, _, leaf = name.rpartition(".")
                setattr(part.get_submodule(owner) if owner else part, leaf, first)
    torch.manual_seed(seed)
    init = getattr(part, "init_weights", None)
    with WholeWeightNormal():
        if callable(init):
            init()
            return
        with torch.no_grad():
            for module in part.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()


class WholeWeightNormal(torch.overrides.TorchFunctionMode):
    """``normal_`` of a DTensor shard on a CPU mesh (where DTensor has no distributed RNG: its
    offset-based tracker needs CUDA's Philox generator) as its window of the values the
    generator draws for the whole weight (`normal_window_`). Left alone, every rank draws the
    same values for its shard: repeated blocks in each weight, and another start than one
    process's. So a model built on the meta device starts as one process builds it, whatever
    the layout (the experts draw per expert, `Experts.init_weights`). Uniform initialisers
    (`_WHOLE_DRAWS`) run on a plain tensor of the whole shape and keep the shard's window, and
    a whole plain value copied into a shard (``copy_``) copies its window."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        # (tensor, mean, std) by position or name: Tensor.normal_ and nn.init.normal_
        given = {**dict(zip(("tensor", "mean", "std"), args)), **kwargs}
        w = given.get("tensor")
        if (
            func in (torch.nn.init.normal_, torch.Tensor.normal_)
            and isinstance(w, DTensor)
            and w.device_mesh.device_type == "cpu"
            and w.dim() > 0
        ):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(
                w.shape, w.device_mesh, w.placements
            )
            window = [slice(o, o + n) for o, n in zip(offset, shape)]
            with torch.no_grad():
                normal_window_(
                    w.to_local(),
                    w.shape,
                    window,
                    mean=given.get("mean", 0.0),
                    std=given.get("std", 1.0),
                    generator=given.get("generator"),
                )
            return w
        if func in _WHOLE_DRAWS and _on_cpu_mesh(w):
            # uniform draws (transformers' kaiming-uniform residual init, Nemotron-H): the
            # function on a plain tensor of the whole shape, this shard's window kept
            whole = torch.empty(w.shape, dtype=w.dtype)
            with torch.no_grad():
                func(whole, *args[1:], **{k: v for k, v in kwargs.items() if k != "tensor"})
                w.to_local().copy_(whole[_window(w)])
            return w
        source = args[1] if len(args) > 1 else kwargs.get("src")
        if (
            func is torch.Tensor.copy_
            and _on_cpu_mesh(w)
            and isinstance(source, torch.Tensor)
            and not isinstance(source, DTensor)
            and source.shape == w.shape
        ):  # a whole value into a shard (transformers' Mamba init: A_log, dt_bias)
            with torch.no_grad():
                w.to_local().copy_(source[_window(w)])
            return w
        return func(*args, **kwargs)


# Initialisers that draw once per element in order: on a shard, the whole draw's window.
_WHOLE_DRAWS = (
    torch.Tensor.uniform_,
    torch.nn.init.uniform_,
    torch.nn.init.kaiming_uniform_,
    torch.nn.init.xavier_uniform_,
)


def _on_cpu_mesh(w) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(w, DTensor) and w.device_mesh.device_type == "cpu" and w.dim() > 0


def _window(w) -> tuple[slice, ...]:
    """The slices of the whole tensor a DTensor's local shard holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def normal_window_(
    out: torch.Tensor,
    shape: "torch.Size",
    window: list[slice],
    *,
    mean: float,
    std: float,
    generator: torch.Generator | None = None,
    block: int = 1 << 20,
) -> torch.Tensor:
    """Fill `out` with ``torch.empty(shape).normal_(mean, std)[window]`` on the CPU (`window`: a
    slice with start and stop per dim), drawing the whole tensor in blocks of rows of about
    `block` elements, so that only one block is held besides `out`. ATen's CPU ``normal_`` draws
    one uniform per element in order and transforms them 16 at a time (the last 16 drawn again
    when the size is not a multiple of 16): blocks of a multiple of 16 elements, the last one at
    least 16, give the whole draw's values bit for bit (tests/test_engine_moe2.py checks it)."""
    rows, per_row = shape[0], math.prod(shape[1:])
    unit = 16 // math.gcd(per_row, 16)  # rows of a multiple of 16 elements
    step = unit * max(1, block // (unit * per_row))
    first, last = window[0].start, window[0].stop
    start = 0
    while start < rows:
        stop = start + step
        if (rows - stop) * per_row < 16:  # the rest joins this block
            stop = rows
        drawn = torch.empty((stop - start, *shape[1:]), dtype=out.dtype)
        drawn.normal_(mean, std, generator=generator)
        lo, hi = max(start, first), min(stop, last)
        if lo < hi:
            rows_in = tuple([slice(lo - start, hi - start)] + window[1:])
            out[lo - first : hi - first].copy_(drawn[rows_in])
        start = stop
    return out
