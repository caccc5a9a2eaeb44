"""One rank of a validation run: `python -m autosearch.validation.worker CONFIG.json` (under
torchrun for several processes). Trains the candidate for a few steps with the Engine and writes
`rank<N>.json` with what it measured, or with the type of the exception that stopped it.

The process torchrun starts is a small guard: it forks the rank (which imports torch) and waits
for it, so that a rank that dies without writing its record (a native crash, a signal, the
kernel's out-of-memory killer) still gets one, written from its exit status: the signal's name,
its peak resident memory, and the cgroup's oom_kill count. The guard then exits the same way.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from autosearch.core.processes import die_with_parent, signal_name

OOM_TYPES = ("OutOfMemoryError", "MemoryError")
# Under an address-space cap (RLIMIT_AS, how a smaller device is emulated on CPU) an allocation
# fails wherever it happens first: in torch's allocator, in the C++ runtime, or in oneDNN, which
# reports a kernel whose code or scratchpad cannot be mapped as "could not create a primitive".
CAPPED_ALLOCATION_FAILURES = ("could not create a primitive", "std::bad_alloc")
_address_space_cap: list[int] = []
# CUDA allocations that fail outside torch's caching allocator surface as a RuntimeError: cuBLAS
# and cuDNN workspaces, NCCL buffers, the CUDA runtime itself.
CUDA_ALLOCATION_FAILURES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; Python raises MemoryError; the CPU allocator raises a
    c10 error (a RuntimeError) whose message comes from DefaultCPUAllocator with ENOMEM."""
    if type(exc).__name__ in OOM_TYPES or isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    message = str(exc)
    if "DefaultCPUAllocator: can't allocate memory" in message:
        return True
    if any(m in message for m in CUDA_ALLOCATION_FAILURES):
        return True
    if "NCCL" in message and "out of memory" in message.lower():  # its buffers, in its words
        return True
    return bool(_address_space_cap) and any(m in message for m in CAPPED_ALLOCATION_FAILURES)


def limit_memory(limit_bytes: int | None, device_type: str) -> None:
    """Emulate a smaller device: cap this process's address space above what it uses now (CPU), or
    the CUDA caching allocator's share of the GPU."""
    if not limit_bytes:
        return
    if device_type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total))
        return
    import torch

    from autosearch.validation.measure import read_status_bytes

    # Start the OpenMP thread team first: thread stacks need address space, and libgomp aborts
    # the process (no exception) if it cannot create its threads under the cap.
    torch.ones(256, 256) @ torch.ones(256, 256)
    vm = read_status_bytes("VmSize")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + int(limit_bytes), hard))
    _address_space_cap.append(vm + int(limit_bytes))


def adamw(params):
    """AdamW at lr 1e-4: the fused kernel on a GPU (torchtitan's default `implementation`, one
    pass over the states, as the cost model's optimizer step prices it), the default on CPU."""
    import torch

    params = list(params)
    first = params[0]["params"][0] if isinstance(params[0], dict) else params[0]
    fused = True if first.device.type == "cuda" else None  # None: torch's default choice
    return torch.optim.AdamW(params, lr=1e-4, fused=fused)


def build_model_factory(config: dict[str, Any]):
    from autosearch.core.model_spec import ModelSpec

    spec = ModelSpec.from_dict(config["model"])
    factory_path = config.get("factory")
    if factory_path:
        from autosearch.validation._factory import load_factory

        return spec, (lambda: load_factory(factory_path)(spec))
    from autosearch.models.transformer import build

    return spec, (lambda: build(spec))


def run(config: dict[str, Any]) -> dict[str, Any]:
    import torch

    from autosearch.core.strategy import Strategy
    from autosearch.engine import Engine
    from autosearch.engine import distributed as D
    from autosearch.engine.data import SyntheticTokens
    from autosearch.validation import measure

    if config.get("threads"):
        torch.set_num_threads(int(config["threads"]))
    strategy = Strategy.from_dict(config["strategy"])
    spec, factory = build_model_factory(config)
    steps, warmup = int(config["steps"]), int(config["warmup"])
    baseline_rss = measure.read_status_bytes("VmRSS")
    measure.reset_peak_rss()
    # On the meta device, then only this rank's shards are allocated: a model larger than one
    # device runs when its strategy shards it (built whole, it would be an "oom").
    engine = Engine(
        factory,
        optimizer=adamw,
        strategy=strategy,
        seed=int(config.get("seed", 0)),
        meta_init=bool(config.get("meta_init", True)),
    )
    engine.prepare(mode="train")
    device = engine.device_
    limit_memory(config.get("memory_limit_bytes"), device.type)
    gbs = strategy.global_batch_size
    data = SyntheticTokens.for_model(spec, n_samples=gbs * (steps + warmup + 1), seed=0)
    # Every batch is built before the first timed step: SyntheticTokens loops over tokens in
    # Python (~50-100 ms a batch of 8 x 2048, the order of a GPU step), not part of a step.
    batches = iter(list(engine.dataloader(data, batch_size=gbs, mode="train")))
    losses: list[float] = []

    def step() -> None:
        losses.append(engine.run(next(batches), mode="train")["loss"])

    times = measure.time_steps(step, warmup + steps, device)
    peak_tensor, how = measure.tensor_peak_bytes(
        step, device, engine.model_parts_, engine.optimizers_
    )
    return {
        **measure.summarize(times, warmup),
        "step_times_s": times,
        "peak_memory_bytes": peak_tensor,
        "peak_memory_method": how,
        "peak_rss_bytes": measure.read_status_bytes("VmHWM"),
        "baseline_rss_bytes": baseline_rss,
        "final_loss": losses[-1],
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "meta_init": engine.meta_init,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "world_size": D.launched_world_size(),
    }


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    record_path = Path(config["result_dir"], f"rank{rank}.json")
    sys.stdout.flush()
    guard_pid = os.getpid()
    pid = os.fork()  # before torch is imported: the guard stays small and single-threaded
    if pid == 0:
        die_with_parent()  # Linux; elsewhere the launcher's process group owner still ends it
        if os.getppid() != guard_pid:  # the guard died already
            os._exit(1)
        run_rank(config, rank, record_path)
    guard(pid, rank, record_path)


def run_rank(config: dict[str, Any], rank: int, record_path: Path) -> NoReturn:
    """Train and measure; write the record (measured, or the exception's type); exit."""
    record: dict[str, Any] = {"rank": rank}
    code = 0
    try:
        record.update(run(config), status="ok")
    except BaseException as exc:  # noqa: BLE001 - recorded by type; the launcher decides what it means
        record.update(
            status="oom" if is_out_of_memory(exc) else "crashed",
            error_type=type(exc).__name__,
            message=str(exc).strip().splitlines()[0][:400] if str(exc).strip() else "",
        )
        traceback.print_exc()
        code = 1
    write_record(record_path, record)
    from autosearch.engine import distributed as D

    D.shutdown(code)


def guard(pid: int, rank: int, record_path: Path) -> NoReturn:
    """Wait for the rank; if it left no record, write one from how it ended; exit like it."""
    stopped: list[int] = []

    def forward(signum: int, frame: object) -> None:  # torchrun stops its workers with SIGTERM
        stopped.append(signum)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    oom_kills = oom_kill_count()
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 and not record_path.exists():
        record = death_record(
            rank,
            code,
            max_rss_bytes=int(usage.ru_maxrss) * 1024,  # Linux reports KiB
            stopped=bool(stopped),
            new_oom_kills=oom_kill_count() - oom_kills,
        )
        write_record(record_path, record)
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # end the same way, so that torchrun (or the launcher) sees the signal
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Whole or not at all: a rank killed while writing leaves no half record."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)


def death_record(
    rank: int, code: int, *, max_rss_bytes: int, stopped: bool, new_oom_kills: int
) -> dict[str, Any]:
    """The record of a rank that ended without writing one, from its exit status alone."""
    record: dict[str, Any] = {"rank": rank, "exit_code": code, "max_rss_bytes": max_rss_bytes}
    rss = f"{max_rss_bytes / 2**20:,.0f} MiB resident at most"
    if code > 0:
        return {
            **record,
            "status": "crashed",
            "error_type": f"exit status {code}",
            "message": f"exited with status {code} without a result ({rss}); see the log",
        }
    name = signal_name(-code)
    if stopped or -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        return {**record, "status": "stopped", "error_type": name, "message": "stopped"}
    if -code == signal.SIGKILL:
        evidence = (
            f"; the cgroup's memory.events counted {new_oom_kills} oom_kill meanwhile"
            if new_oom_kills > 0
            else ""
        )
        return {
            **record,
            "status": "oom",
            "error_type": name,
            "message": f"killed by SIGKILL with {rss}: the kernel's out-of-memory killer (or a "
            f"memory limit) ends a process this way{evidence}",
        }
    return {
        **record,
        "status": "crashed",
        "error_type": name,
        "message": f"killed by {name} ({signal.strsignal(-code)}): a native crash in torch, a "
        f"library or the model code ({rss}); see the log",
    }


def oom_kill_count() -> int:
    """The kernel's count of OOM kills in this process's cgroup (cgroup v2), 0 where unreadable."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            path = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        with open(f"/sys/fs/cgroup{path}/memory.events", encoding="ascii") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, StopIteration, ValueError):
        pass
    return 0


if __name__ == "__main__":
    main()
