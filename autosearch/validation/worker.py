"""One rank of a validation run: `python -m autosearch.validation.worker CONFIG.json` (under torchrun
for several processes). Trains the candidate for a few steps with the Engine and writes
`rank<N>.json` with what it measured, or with the type of the exception that stopped it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from pathlib import Path
from typing import Any

OOM_TYPES = ("OutOfMemoryError", "MemoryError")
# Under an address-space cap (RLIMIT_AS, how a smaller device is emulated on CPU) an allocation
# fails wherever it happens first: in torch's allocator, in the C++ runtime, or in oneDNN, which
# reports a kernel whose code or scratchpad cannot be mapped as "could not create a primitive".
CAPPED_ALLOCATION_FAILURES = ("could not create a primitive", "std::bad_alloc")
_address_space_cap: list[int] = []


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


def load_factory(path: str):
    """``"package.module:function"`` or ``"path/to/file.py:function"``: a function ModelSpec -> nn.Module."""
    import importlib
    import importlib.util

    where, _, name = path.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def build_model_factory(config: dict[str, Any]):
    from autosearch.core.model_spec import ModelSpec

    spec = ModelSpec.from_dict(config["model"])
    factory_path = config.get("factory")
    if factory_path:
        return spec, (lambda: load_factory(factory_path)(spec))
    from autosearch.transformer import build

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
    engine = Engine(
        factory,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        strategy=strategy,
        seed=int(config.get("seed", 0)),
    )
    engine.prepare(mode="train")
    device = engine.device_
    limit_memory(config.get("memory_limit_bytes"), device.type)
    gbs = strategy.global_batch_size
    data = SyntheticTokens.for_model(spec, n_samples=gbs * (steps + warmup + 1), seed=0)
    batches = iter(engine.dataloader(data, batch_size=gbs, mode="train"))
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
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "world_size": D.launched_world_size(),
    }


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
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
    Path(config["result_dir"], f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    from autosearch.engine import distributed as D

    D.shutdown(code)


if __name__ == "__main__":
    main()
