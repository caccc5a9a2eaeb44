"""Run candidates for real, one after another, and record measured next to predicted."""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autosearch.core.errors import SpecError
from autosearch.core.runtime import engine_lacks
from autosearch.core.schema import read_count, read_integer, read_positive
from autosearch.tuning import Candidate  # the one candidate record (tuning/_result.py)
from autosearch.validation._config import read_steps_before
from autosearch.validation._factory import check_factory
from autosearch.validation._launch import OK, RunOutcome, launch
from autosearch.validation._slurm import launch_slurm
from cost_models.calibration.machine import (
    UNDER_LOAD_SHARE,
    Load,
    cpu_time_sample,
    load_average,
    load_between,
    read_load,
)

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    import pandas as pd

    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy
    from autosearch.validation._slurm import SlurmOptions

VALIDATION_ATTR = "validation"


@dataclass
class ValidationResult:
    """Every run, and the best measured one.

    Attributes:
        table: one row per candidate (``validation.csv``).
        best: the candidate with the highest measured throughput among those that ran, or None.
        best_row: its row of `table`.
    """

    table: "pd.DataFrame"
    best: Candidate | None
    best_row: dict[str, Any] | None = None
    outcomes: list[RunOutcome] = field(default_factory=list)


# On CPU, a run of more processes than this many per core is refused unless forced.
MAX_PROCESSES_PER_CORE = 4


def available_devices() -> tuple[str, int]:
    """('cuda', GPU count) when GPUs are visible, else ('cpu', usable cores).

    Torch-free: torch's own answer when the caller imported torch already (Engine.tune), else the
    NVIDIA driver's list of GPUs (/proc/driver/nvidia/gpus) filtered by CUDA_VISIBLE_DEVICES.
    """
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda"):
        if torch.cuda.is_available():
            return "cuda", torch.cuda.device_count()
        return "cpu", _cores()
    gpus = nvidia_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus and visible is not None:
        gpus = min(gpus, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    if gpus and torch_build() == "cpu":
        print(
            f"warning: this machine has {gpus} NVIDIA GPU(s) but the installed torch is a "
            "CPU-only build: the runs go on CPU (with gloo). Install the CUDA build of the same "
            "torch from PyTorch's CUDA wheel index to validate on the GPUs",
            file=sys.stderr,
        )
        return "cpu", _cores()
    return ("cuda", gpus) if gpus else ("cpu", _cores())


def nvidia_gpus() -> int:
    """NVIDIA GPUs the driver lists (/proc/driver/nvidia/gpus, else `nvidia-smi -L` where a
    container or VM hides /proc/driver), whatever torch was built for."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines())


def torch_build() -> str | None:
    """'cuda', 'rocm' or 'cpu': what the installed torch was built for, read from its
    `torch/version.py` without importing torch; None when torch is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    # `cuda: Optional[str] = '13.0'` in a CUDA build, `= None` in a CPU or ROCm one
    built = dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(.+?)\s*$", text, flags=re.M))
    if built.get("cuda", "None") != "None":
        return "cuda"
    return "rocm" if built.get("hip", "None") != "None" else "cpu"


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _available_memory_bytes() -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def too_big_for_this_cpu(
    model: "ModelSpec",
    cands: "list[Candidate]",
    *,
    cores: int,
    memory_limit_bytes: int | None,
    available_bytes: float | None,
) -> list[str]:
    """Candidates this machine cannot run on CPU: more than MAX_PROCESSES_PER_CORE processes per
    core, or more memory (processes x the cost model's per-device estimate) than is available."""
    from autosearch.core.hardware import Cluster
    from cost_models.analytic import AnalyticCostModel

    problems = []
    for i, cand in enumerate(cands):
        s = cand.strategy
        world = s.world_size
        label = f"candidate {i} ({s.short()})"
        if s.problems(model):  # an invalid candidate becomes a row; it starts nothing
            continue
        if world > MAX_PROCESSES_PER_CORE * cores:
            problems.append(
                f"{label} would start {world} processes on {cores} cores (more than "
                f"{MAX_PROCESSES_PER_CORE} per core)"
            )
            continue
        report = cand.report
        if report is None:  # tensor memory does not depend on the GPU: price it on a catalog one
            try:
                c = Cluster(gpu="h100-sxm", n_nodes=1, gpus_per_node=world)
                report = AnalyticCostModel(model, c).estimate(s)
            except SpecError:
                continue
        need = report.peak_memory_bytes - report.memory.other_bytes
        if memory_limit_bytes:
            need = min(need, memory_limit_bytes)
        if available_bytes is not None and world * need > available_bytes:
            problems.append(
                f"{label} needs about {world * need / 2**30:,.1f} GiB ({world} processes x "
                f"{need / 2**30:,.2f} GiB by the cost model's estimate) and this machine has "
                f"{available_bytes / 2**30:,.1f} GiB available"
            )
    return problems


def validate(
    model: "ModelSpec | str",
    candidates: "Sequence[Candidate | Strategy]",
    *,
    cluster: "Cluster | str | None" = None,
    steps: int = 10,
    warmup: int = 3,
    timeout_s: float = 600.0,
    out: "str | os.PathLike" = "results/validation",
    memory_limit_bytes: int | None = None,
    factory: str | None = None,
    threads: int | None = None,
    study: "optuna.Study | None" = None,
    runtime: str | None = None,
    verbose: bool = True,
    force: bool = False,
    launcher: str = "local",
    slurm: "SlurmOptions | None" = None,
) -> ValidationResult:
    """Run each candidate for `warmup + steps` optimizer steps and measure it.

    Args:
        model: the ModelSpec trained (the reference transformer unless `factory` is given).
        candidates: strategies (or Candidates with their predicted CostReport), in order.
        cluster: the cluster the predictions are for; candidates without a report are scored on it
            (by default, this machine's calibrated profile if one exists).
        steps, warmup: measured steps after warm-up steps; the step time is the median.
        timeout_s: a run not finished by then is killed and recorded as a timeout.
        out: folder for `validation.csv` and each run's config, log and per-rank results.
        memory_limit_bytes: emulate a smaller device (per process); a run exceeding it fails
            with OOM.
        factory: ``"module:function"`` or ``"file.py:function"`` building the model from its
            ModelSpec, instead of the reference. It is user code: imported here once (and
            checked) before any run, then on every rank of every run.
        threads: intra-op threads per process (default: the cores other processes leave free,
            divided by the processes, at least 1: two threads on two cores with one core busy
            ran a step 8-17x slower than on the quiet machine). Said when load lowers it, and
            warned when a given value oversubscribes the cores.
        study: an Optuna study whose trials get the measured figures as user attributes.
        runtime: the cost model's runtime options for candidates scored here.
        force: on CPU, run candidates even with more than 4 processes per core or more memory
            (by the cost model's estimate) than this machine has available.
        launcher: "local" (torchrun on this machine) or "slurm": each candidate is a SLURM job
            at its real scale (nodes x GPUs per node of `cluster`, which is then required),
            submitted with `slurm` options; a job pending too long is cancelled and recorded
            as "pending".

    Before each run on this machine, the load is read (`cost_models.calibration.machine`: the
    CPU time other processes take over one second, and the load average; printed before the
    first); a loaded machine is warned about, not refused (CI machines are loaded). Each row
    records the load before and during its run (``load_average_before``,
    ``load_average_after``, ``other_busy_cores_before``, ``other_busy_cores``, ``cores``) and
    ``under_load``: other processes kept more than `UNDER_LOAD_SHARE` of the cores busy, so
    its measured time is the load's as much as the model's, and its line says so.

    Returns:
        A ValidationResult; failures (OOM, crash, timeout) are rows, not exceptions.

    Raises:
        SpecError: before any run, for a factory that cannot be imported or is not a function,
            and on CPU for candidates beyond this machine (unless `force`).
    """
    import pandas as pd

    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec
    from cost_models.analytic import AnalyticCostModel

    model = ModelSpec.load(model)
    # the numbers `ValidateConfig` checks for the CLI, checked the same way from Python
    steps = read_count(steps, "steps")
    warmup = read_steps_before(warmup, "warmup")
    timeout_s = read_positive("seconds", "600")(timeout_s, "timeout_s")
    if memory_limit_bytes is not None:
        memory_limit_bytes = read_integer(memory_limit_bytes, "memory_limit_bytes", 1, 1 << 50)
    if threads is not None:
        threads = read_count(threads, "threads")
    if launcher not in ("local", "slurm"):
        raise SpecError(f"launcher must be local or slurm, got {launcher!r}")
    target: Cluster | None = None
    if launcher == "slurm":
        from autosearch.validation._slurm import SlurmOptions, check_slurm

        if cluster is None:
            raise SpecError(
                "--launcher slurm needs --cluster (its nodes x GPUs per node are the jobs' "
                "layout), or a study that records one"
            )
        check_slurm()
        slurm = slurm or SlurmOptions()
        target = Cluster.parse(cluster) if not isinstance(cluster, Cluster) else cluster
        on_gpus = target.profile.device_type == "cuda" if slurm.gpus is None else slurm.gpus
        device_type, n_devices = ("cuda" if on_gpus else "cpu"), target.world_size
        force = True  # nothing runs on this machine
    else:
        device_type, n_devices = available_devices()
    cands = [c if isinstance(c, Candidate) else Candidate(c) for c in candidates]
    if not cands:
        raise SpecError(
            "no candidate to validate: give strategies, or a study with completed feasible trials"
        )
    if factory:
        check_factory(factory)
    if device_type == "cpu" and not force:
        too_big = too_big_for_this_cpu(
            model,
            cands,
            cores=n_devices,
            memory_limit_bytes=memory_limit_bytes,
            available_bytes=_available_memory_bytes(),
        )
        if too_big:
            raise SpecError(
                too_big,
                context="validate runs every process on this machine's CPU and will not start "
                "these (validate on the target cluster, choose smaller candidates, emulate a "
                "smaller device with --memory-limit-gib, or pass --force / force=True to run "
                "them anyway)",
            )
    load = read_load() if launcher == "local" else None
    if load is not None and verbose:
        print(_load_line(load, device_type), flush=True)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "validation.csv"
    rows: list[dict[str, Any]] = []
    outcomes: list[RunOutcome] = []
    for i, cand in enumerate(cands):
        s: Strategy = cand.strategy
        world = s.world_size
        report = cand.report
        if report is None and cluster is not None:
            c = Cluster.parse(cluster) if not isinstance(cluster, Cluster) else cluster
            shape = (1, world) if target is None else _layout(world, c)
            try:
                if isinstance(shape, str):  # no whole-node layout: nothing to predict
                    raise SpecError(shape)
                if c.world_size != world:
                    c = Cluster(gpu=c.gpu, n_nodes=shape[0], gpus_per_node=shape[1])
                report = AnalyticCostModel(model, c, runtime=runtime).estimate(s)
            except SpecError:
                report = None
        row: dict[str, Any] = {
            "candidate": i,
            "trial_number": cand.trial_number,
            "strategy": s.short(),
            **s.to_dict(),
            "world_size": world,
            "model": model.name,
        }
        problems = s.problems(model) + engine_lacks(s, "cpu" if device_type == "cpu" else None)
        if device_type == "cuda" and world > n_devices:
            problems.append(
                f"needs {world} GPUs, this machine has {n_devices}; run validation on the "
                "target cluster"
                if target is None
                else f"needs {world} GPUs, the cluster {target} has {n_devices}"
            )
        if target is not None and not problems and isinstance(_layout(world, target), str):
            problems.append(str(_layout(world, target)))
        if problems:
            row.update(status="invalid", reason="; ".join(problems))
            outcome = RunOutcome("invalid", "; ".join(problems))
        else:
            cores = n_devices if target is None else (slurm.cpus_per_task if slurm else 0) or 1
            n_threads = threads or max(1, (cores if device_type == "cpu" else 1) // world)
            if load is not None and i > 0:  # the load of now, not of the first run's start
                load = read_load()
            if device_type == "cpu" and load is not None:
                n_threads, note = threads_for(world, threads, load)
                if note and verbose:
                    print(f"    {note}", flush=True)
            config = {
                "model": model.to_dict(),
                "strategy": s.to_dict(),
                "steps": steps,
                "warmup": warmup,
                "threads": n_threads if device_type == "cpu" else None,
                "factory": factory,
                "memory_limit_bytes": memory_limit_bytes,
                "seed": 0,
            }
            if verbose:
                print(f"[{i + 1}/{len(cands)}] {s.short()} on {world} process(es) ...", flush=True)
            run_dir = out_dir / f"run{i:03d}_{s.short()}"
            if target is not None and slurm is not None:
                outcome = launch_slurm(
                    config,
                    nproc=world,
                    gpus_per_node=target.gpus_per_node,
                    gpus=device_type == "cuda",
                    run_dir=run_dir,
                    timeout_s=timeout_s,
                    options=slurm,
                    name=f"autosearch-validate-{i:03d}",
                )
                row.update({f"slurm_{k}": v for k, v in outcome.slurm.items()})
            else:
                average, before = load_average(), cpu_time_sample()
                outcome = launch(config, nproc=world, run_dir=run_dir, timeout_s=timeout_s)
                row.update(_load_columns(load, before, average))
            row.update(
                status=outcome.status,
                reason=outcome.reason,
                exit_code=outcome.exit_code,
                wall_s=round(outcome.wall_s, 2),
                log=outcome.log_path,
            )
            if outcome.status == OK:
                row.update(_measured(outcome, s, model))
        if report is not None:
            # Tensor memory against tensor memory: what a run measures (CUDA max allocated, the
            # CPU tensor tracker) excludes the runtime's reserve (CUDA context, torch itself),
            # which the prediction lists apart as `other`; the total is kept beside the process
            # peak RSS.
            row.update(
                predicted_step_time_s=report.step_time_s,
                predicted_peak_memory_bytes=report.peak_memory_bytes - report.memory.other_bytes,
                predicted_total_memory_bytes=report.peak_memory_bytes,
                predicted_fits=report.fits,
                **{
                    f"predicted_{k}": v
                    for k, v in report.to_dict().items()
                    if k.startswith("time_")
                },
            )
        if "measured_step_time_s" in row and report is not None:
            row["step_time_error_pct"] = 100 * (
                report.step_time_s / row["measured_step_time_s"] - 1
            )
            if not math.isnan(row["measured_peak_memory_bytes"]):
                row["memory_error_pct"] = memory_error_pct(
                    report, row["measured_peak_memory_bytes"]
                )
        if verbose:
            print("    " + _one_line(row), flush=True)
        rows.append(row)
        outcomes.append(outcome)
        _write_csv(pd.DataFrame(rows), csv_path)  # after every run: nothing measured is lost
        if study is not None and cand.trial_number is not None:
            _record_in_study(study, cand.trial_number, row)
    table = pd.DataFrame(rows)
    ok = table[table.status == OK] if "status" in table else table.iloc[0:0]
    best, best_row = None, None
    if len(ok):
        idx = ok.measured_tokens_per_s.idxmax()
        best, best_row = cands[int(table.loc[idx, "candidate"])], table.loc[idx].to_dict()
    return ValidationResult(table, best, best_row, outcomes)


def _layout(world: int, cluster: "Cluster") -> "tuple[int, int] | str":
    """(nodes, processes per node) of a run of `world` on `cluster`'s nodes, or why not."""
    from autosearch.validation._slurm import layout

    try:
        return layout(world, cluster.gpus_per_node)
    except SpecError as exc:
        return str(exc)


def memory_error_pct(report: Any, measured_tensor_bytes: float) -> float:
    """Predicted against measured peak tensor memory, in percent. Both without the runtime's
    reserve (CUDA context, torch itself: the profile's `reserved_bytes`, which the prediction
    lists as `memory.other_bytes`): dividing the total by a tensor peak reported +301% for a
    +12% error on an H200 profile (shared/notes/cuda-review.md, finding 3)."""
    predicted = report.peak_memory_bytes - report.memory.other_bytes
    return 100 * (predicted / measured_tensor_bytes - 1)


def _write_csv(table: "pd.DataFrame", path: Path) -> None:
    """Replace `path` atomically: a kill leaves the previous table, never half of one."""
    partial = path.with_name(path.name + ".partial")
    table.to_csv(partial, index=False)
    os.replace(partial, path)


def _measured(outcome: RunOutcome, s: "Strategy", model: "ModelSpec") -> dict[str, Any]:
    ranks = outcome.ranks
    step = max(
        r["step_time_s"] for r in ranks
    )  # every rank timed the same barriers: take the slowest
    peaks = [r.get("peak_memory_bytes", float("nan")) for r in ranks]
    r0 = ranks[0]
    per_step = [
        max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))
    ]  # the slowest rank, step by step
    return {
        "measured_step_times_s": ";".join(f"{x:.6f}" for x in per_step),
        "measured_step_time_s": step,
        "measured_step_time_min_s": min(r["step_time_min_s"] for r in ranks),
        "measured_step_time_max_s": max(r["step_time_max_s"] for r in ranks),
        "measured_tokens_per_s": s.global_batch_size * model.seq_len / step,
        "measured_peak_memory_bytes": max(peaks),
        "measured_peak_memory_per_rank": ";".join(f"{p:.0f}" for p in peaks),
        "measured_peak_rss_bytes": max(r.get("peak_rss_bytes", 0) for r in ranks),
        "peak_memory_method": r0.get("peak_memory_method"),
        "final_loss": r0.get("final_loss"),
        "device": r0.get("device"),
        "threads": r0.get("threads"),
        "torch_version": r0.get("torch_version"),
        "steps_measured": r0.get("steps_measured"),
    }


def _one_line(row: dict[str, Any]) -> str:
    if row["status"] != OK:
        return f"{row['status'].upper()}: {row.get('reason', '')}"
    text = (
        f"ok: step {row['measured_step_time_s'] * 1e3:.1f} ms, "
        f"peak {row['measured_peak_memory_bytes'] / 2**20:.0f} MiB"
    )
    if "predicted_step_time_s" in row:
        text += (
            f" (predicted {row['predicted_step_time_s'] * 1e3:.1f} ms, "
            f"{row['predicted_peak_memory_bytes'] / 2**20:.0f} MiB)"
        )
    if row.get("under_load"):
        error = row.get("step_time_error_pct")
        text += (
            f"; UNDER LOAD: other processes kept {row['other_busy_cores']:.1f} of "
            f"{row['cores']} cores busy during the run, so the measured time is the load's as "
            "much as the model's"
            + (f" (step time error {error:+.0f}%)" if error is not None else "")
        )
    return text


def _load_line(load: Load, device_type: str) -> str:
    """What validate says of the machine's load before its runs."""
    if not load.loaded:
        return f"validate: load: {load.describe()}: quiet enough to measure"
    where = "their CPU work" if device_type == "cuda" else "every step"
    return (
        f"validate: WARNING load: {load.describe()} ({load.busy_cores / load.cores:.0%} of the "
        f"cores, more than {UNDER_LOAD_SHARE:.0%}): the runs share the cores, so {where} will "
        "be slower than on a quiet machine and than the model predicts; each row says whether "
        "its run was under load (validation.csv: under_load, other_busy_cores)"
    )


def threads_for(world: int, threads: int | None, load: Load) -> tuple[int, str]:
    """Intra-op threads per process of a CPU run of `world` processes, and what to say about
    it: processes x threads fit in the cores others leave free (`Load.threads_per_process`),
    unless `threads` was given (kept, with a warning when it oversubscribes)."""
    free = load.free_cores()
    if threads:
        if world * threads > free:
            return threads, (
                f"threads: {world} process(es) x {threads} thread(s) oversubscribe the {free} "
                f"free core(s) ({load.describe()}): kept as asked; the measured times will "
                "show it"
            )
        return threads, ""
    fit, quiet = load.threads_per_process(world), max(1, load.cores // world)
    if world * fit > free:
        return fit, (
            f"threads: 1 per process; {world} processes oversubscribe the {free} free core(s) "
            f"of {load.cores} ({load.describe()})"
        )
    if fit < quiet:
        return fit, (
            f"threads: {fit} per process, not {quiet}: {load.describe()}, and {world} x "
            f"{quiet} threads would oversubscribe the {free} free core(s)"
        )
    return fit, ""


def _load_columns(
    load: Load | None, before: dict[str, float], average: list[float] | None
) -> dict[str, Any]:
    """The load before and during one run (`cpu_time_sample` and the load average taken just
    before it), as validation.csv's columns."""
    during = load_between(before, cpu_time_sample())
    after = load_average()
    other = round(during["load_other_cores"], 2) if during else None
    cores = load.cores if load is not None else int(during.get("load_cores", 0)) or None
    busy = other if other is not None else (load.busy_cores if load is not None else None)
    return {
        "cores": cores,
        "load_average_before": average[0] if average else None,
        "load_average_after": after[0] if after else None,
        "other_busy_cores_before": load.other_cores if load is not None else None,
        "other_busy_cores": other,
        "under_load": bool(cores and busy is not None and busy > UNDER_LOAD_SHARE * cores),
    }


def _record_in_study(study: "optuna.Study", trial_number: int, row: dict[str, Any]) -> None:
    """Measured figures next to the predicted ones, kept in the study.

    Optuna refuses to change a finished trial (UpdateFinishedTrialError), so they are a study
    user attribute per validated trial, ``validation/<trial number>``, which `trials.csv` readers
    can join on the trial number; the trial's own attributes keep the prediction (its CostReport).
    """
    keep = (
        "status",
        "reason",
        "measured_step_time_s",
        "measured_peak_memory_bytes",
        "measured_tokens_per_s",
        "predicted_step_time_s",
        "predicted_peak_memory_bytes",
        "step_time_error_pct",
        "memory_error_pct",
        "measured_peak_rss_bytes",
        "device",
        "threads",
        "torch_version",
        "under_load",
        "other_busy_cores",
        "cores",
    )
    record = {
        k: row[k]
        for k in keep
        if k in row
        and row[k] is not None
        and not (isinstance(row[k], float) and math.isnan(row[k]))
    }
    record = {k: (v.item() if hasattr(v, "item") else v) for k, v in record.items()}
    study.set_user_attr(f"{VALIDATION_ATTR}/{trial_number}", record)


def candidates_from_study(study: "optuna.Study", *, top_k: int = 3) -> list[Candidate]:
    """`top_k` feasible strategies of a tuner study to run, of distinct kinds where it can."""
    from optuna.trial import TrialState

    from autosearch.tuning import read_candidates

    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return distinct_kinds(read_candidates(trials, top_k=None), top_k)


def kind_key(strategy: "Strategy") -> tuple:
    """What makes two strategies a different *kind* for validation: the parallel axes in use,
    the ZeRO stage, the recompute kind and the precision (`autosearch.core.bands` groups the
    model's errors by these)."""
    s = strategy
    axes = (s.dp > 1, s.tp > 1, s.pp > 1, s.cp > 1)
    return axes, s.zero_stage == 3, s.recompute, s.fp8 if s.fp8 != "none" else s.amp


def distinct_kinds(ranked: "Sequence[Candidate]", k: int) -> list[Candidate]:
    """The best candidate of each kind, in rank order, up to `k`; then the best of the rest.

    Validating near-duplicates of one strategy measures one error k times; one run per kind
    measures where the model may be wrong."""
    picked: list[Candidate] = []
    seen: set[tuple] = set()
    for c in ranked:
        key = kind_key(c.strategy)
        if key not in seen:
            seen.add(key)
            picked.append(c)
        if len(picked) == k:
            return picked
    rest = [c for c in ranked if c not in picked]
    return picked + rest[: k - len(picked)]
