"""Build the model the Engine runs: from an instance or a factory, on the meta device or not,
wrapped when it is a known transformers model; check a strategy against it; allocate and
initialise meta-device parts once parallelized."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from autosearch.core.errors import SpecError
from autosearch.engine.plan import ParallelPlan

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.strategy import Strategy


def is_module(obj) -> bool:
    return isinstance(obj, nn.Module)


def wrap_known(model: nn.Module) -> nn.Module:
    """A transformers Llama / Mistral / Qwen2 causal LM wrapped in `HFCausalLM` (its plan and
    ModelSpec); any other module as it is."""
    if type(model).__module__.startswith("transformers."):
        from autosearch.engine.hf import HFCausalLM, is_supported_hf_model

        if is_supported_hf_model(model):
            return HFCausalLM(model)
    return model


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


def strategy_problems(strategy: "Strategy", plan: ParallelPlan, model: nn.Module) -> list[str]:
    """Why `strategy` cannot run `model` with `plan` (empty when it can)."""
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
    problems += engine_lacks(strategy)
    if strategy.recompute == "selective" and (
        plan.attention_core is None or blocks_of(model, plan) is None
    ):
        problems.append(
            "recompute=selective needs ParallelPlan(attention_core=...) naming the attention "
            "core of "
            "each block; use recompute=full or give the plan"
        )
    return problems


def engine_lacks(strategy: "Strategy") -> list[str]:
    """The dimensions of today's stacks the Engine does not run (the `torch` runtime preset's
    `supports` in cost_models/runtimes.yaml), each with what to do instead."""
    from autosearch.core import RUNTIMES

    return [
        f"the Engine cannot run {how} on this machine's torch.distributed yet; leave it out, or "
        f"export the strategy to a runtime that has it (`autosearch export --to torchtitan`)"
        for how in RUNTIMES["torch"].unsupported(strategy).values()
    ]


def materialize(part: nn.Module, *, device: torch.device, seed: int) -> None:
    """Allocate a meta-device part on `device` (this rank's shards only) and initialise it with
    its ``init_weights()``, else each submodule's ``reset_parameters()``, seeded by `seed`."""
    part.to_empty(device=device)
    torch.manual_seed(seed)
    init = getattr(part, "init_weights", None)
    if callable(init):
        init()
        return
    with torch.no_grad():
        for module in part.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
