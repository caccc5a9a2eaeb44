"""An export is checked before it is written: the strategy priced under the target framework.

A plan tuned for one runtime (the Engine, say) is not the plan for another: Megatron-Core overlaps
other communication, runs other kernels and holds other buffers, so the same strategy runs at
another speed there, may not fit there, and another strategy may be that framework's best. So
before a strategy is written out for a framework, `check_export` estimates it under that
framework's runtime preset (`FRAMEWORK_RUNTIME`) with the memory margin the search would hold
back, and, when the strategy was tuned for another runtime, runs `tune --runtime <target>` for
the same case to say what that framework's own pick is. `autosearch export` refuses a strategy
that does not fit (or cannot run) there unless forced, and then marks the files; `autosearch
tune` prints each framework's own pick beside its plan (`framework_picks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.report import CostReport
    from autosearch.core.strategy import Strategy
    from autosearch.tuning._config import TuneConfig
    from autosearch.tuning._margin import MemoryMargin

# The runtime preset (cost_models/runtimes.yaml) each exporter's framework runs as.
FRAMEWORK_RUNTIME = {
    "megatron": "megatron-core",
    "torchtitan": "torchtitan",
    "deepspeed": "deepspeed",
}
GiB = float(1 << 30)


@dataclass(frozen=True)
class Pick:
    """A framework's own pick for the case: what `tune --runtime <runtime>` finds."""

    runtime: str
    strategy: "Strategy | None"
    report: "CostReport | None"
    why_none: str = ""  # when nothing fits there, or the search was refused

    def line(self) -> str:
        if self.strategy is None or self.report is None:
            return f"{self.runtime}: no strategy ({self.why_none})"
        return f"{self.strategy.short()} at {self.report.tokens_per_s:,.0f} tokens/s"


@dataclass(frozen=True)
class ExportCheck:
    """The strategy priced under the target framework before it is written.

    Attributes:
        target: the exporter (``megatron``, ``torchtitan``, ``deepspeed``).
        runtime: its runtime preset.
        report: the strategy's CostReport there, with the margin held back (None when the
            runtime cannot run it: `refused` says why).
        margin: the memory held back.
        refused: why the runtime cannot run the strategy (empty when it can).
        tuned_for: the runtime the strategy was tuned for, when known.
        own_pick: what `tune --runtime <runtime>` picks, when the strategy was tuned for another
            runtime (None otherwise, or when not asked).
    """

    target: str
    runtime: str
    report: "CostReport | None"
    margin: "MemoryMargin"
    refused: str = ""
    tuned_for: str | None = None
    own_pick: Pick | None = None

    @property
    def ok(self) -> bool:
        """The strategy runs and fits there."""
        return self.report is not None and self.report.fits

    def lines(self) -> list[str]:
        """What the export prints (and, when forced, writes on top of its files)."""
        r = self.report
        head = f"{self.target}: priced as runtime {self.runtime}"
        if r is None:
            lines = [f"{head}: it cannot run this strategy: {self.refused}"]
        else:
            usable = (r.memory_capacity_bytes - r.memory_margin_bytes) / GiB
            verdict = (
                "fits"
                if r.fits
                else f"DOES NOT FIT ({r.peak_memory_bytes / usable / GiB:.2f} x the usable memory)"
            )
            lines = [
                f"{head}: {r.tokens_per_s:,.0f} tokens/s, step {r.step_time_s:.3g} s, "
                f"{r.peak_memory_bytes / GiB:.1f} GiB of {usable:.1f} GiB usable "
                f"({r.memory_capacity_bytes / GiB:.0f} GiB less a {self.margin.fraction:.1%} "
                f"margin): {verdict}"
            ]
        if self.tuned_for is not None and self.tuned_for != self.runtime:
            lines.append(
                f"this strategy was tuned for runtime {self.tuned_for}, not {self.runtime}"
                + (
                    f"; `autosearch tune --runtime {self.runtime}` picks {self.own_pick.line()}"
                    if self.own_pick is not None
                    else ""
                )
            )
        return lines


def check_export(
    strategy: "Strategy",
    *,
    target: str,
    model: "ModelSpec",
    cluster: "Cluster",
    tuned_for: str | None = None,
    search: "TuneConfig | None" = None,
    memory_margin: float | None = None,
) -> ExportCheck:
    """`strategy` priced under `target`'s runtime preset, with the search's memory margin.

    Args:
        strategy, model, cluster: what is exported.
        target: the exporter's name (a key of `FRAMEWORK_RUNTIME`).
        tuned_for: the runtime the strategy was tuned for (a best_strategy.yaml records it);
            None: unknown, nothing is said about it.
        search: when the strategy was tuned for another runtime, the case's TuneConfig: the
            target's own pick is searched from it with ``runtime`` replaced (None: not searched).
        memory_margin: the fraction held back (default: the search's rule for that runtime).
    """
    from autosearch.core.runtime import RuntimeOptions
    from autosearch.tuning._margin import memory_margin as margin_of
    from cost_models.analytic import AnalyticCostModel

    runtime = FRAMEWORK_RUNTIME.get(target)
    if runtime is None:
        raise SpecError(
            f"unknown framework {target!r} to export to; choose one of "
            f"{', '.join(FRAMEWORK_RUNTIME)}"
        )
    rt = RuntimeOptions.get(runtime)
    margin = margin_of(rt, cluster, override=memory_margin)
    report, refused = None, ""
    try:  # a runtime that does not train the model's blocks (a hybrid) refuses it whole
        r = AnalyticCostModel(model, cluster, runtime=rt).estimate(strategy)
        report = r.with_margin(margin.bytes_of(r.memory_capacity_bytes))
    except (SpecError, ValueError) as exc:
        refused = str(exc)
    own = None
    if search is not None and tuned_for is not None and tuned_for != runtime:
        own = own_pick(search, runtime)
    return ExportCheck(
        target=target,
        runtime=runtime,
        report=report,
        margin=margin,
        refused=refused,
        tuned_for=tuned_for,
        own_pick=own,
    )


def own_pick(config: "TuneConfig", runtime: str) -> Pick:
    """What `tune --runtime <runtime>` picks for the case of `config` (searched in memory, with
    the config's budget and seed; its space, pins and fp8 choice kept where the runtime runs
    them)."""
    from autosearch.tuning._result import NoFeasibleStrategyError
    from autosearch.tuning._study import tune

    case = config.replace(
        runtime=runtime, out=None, storage=None, study_name=None, top_k=1, space=None
    )
    try:
        result = tune(case)
    except NoFeasibleStrategyError as exc:
        return Pick(runtime, None, None, why_none=str(exc).split(". ")[0])
    except SpecError as exc:  # a pin the runtime cannot run, say
        return Pick(runtime, None, None, why_none=str(exc))
    return Pick(runtime, result.best_strategy, result.best_report)


def framework_picks(config: "TuneConfig", *, jobs: int = 0) -> dict[str, Pick]:
    """Each framework's own pick for the case of `config` ({exporter: Pick}), the searches run
    in parallel processes (`jobs`, default one per core), skipping the config's own runtime."""
    import multiprocessing
    import os

    own = config.runtime or "torch"
    todo = [(name, rt) for name, rt in FRAMEWORK_RUNTIME.items() if rt != own]
    if not todo:
        return {}
    jobs = max(1, min(jobs or (os.cpu_count() or 1), len(todo)))
    work: list[tuple[Any, str]] = [(config, rt) for _, rt in todo]
    if jobs == 1:
        picks = [own_pick(*w) for w in work]
    else:
        from autosearch.tuning._sweep import _worker_init

        with multiprocessing.get_context("spawn").Pool(jobs, initializer=_worker_init) as pool:
            picks = pool.starmap(own_pick, work)
    return {name: pick for (name, _), pick in zip(todo, picks)}
