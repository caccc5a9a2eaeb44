"""Process-group setup and teardown for the Engine, under torchrun or as a plain process.

`run_main` is the entry point wrapper every distributed script should use: it turns a SpecError
into one message printed by rank 0 (every rank stops before any training step, none hangs), and
ends each process with ``destroy_process_group()``, a flush and ``os._exit``. The last part is a
workaround, not decoration: on CPU/gloo 5-14% of runs abort at interpreter exit when a gloo
worker thread drops a tensor while Python finalizes (measured in shared/notes); exiting without
finalization removed it in 50 of 50 runs.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist

from autosearch.core.errors import SpecError

_SPEC_ERROR_GRACE_S = 3.0


def env_int(name: str, default: int, *, low: int) -> int:
    """An integer that torchrun (or SLURM, or a user) sets in the environment, checked: a
    malformed one is named, not parsed into a bare "invalid literal for int()"."""
    text = os.environ.get(name, "")
    if not text.strip():
        return default
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < low:
        raise SpecError(
            f"the environment variable {name}={text!r} is not an integer >= {low}; torchrun "
            f"sets it for each process: unset it to run as one process, or launch with torchrun"
        )
    return value


def launched_world_size() -> int:
    """Processes of this run: the process group's size, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return env_int("WORLD_SIZE", 1, low=1)


def rank() -> int:
    return (
        dist.get_rank()
        if dist.is_available() and dist.is_initialized()
        else env_int("RANK", 0, low=0)
    )


def is_rank0() -> bool:
    return rank() == 0


def device() -> torch.device:
    """The device of this process: its GPU (``cuda:LOCAL_RANK``) when CUDA is present, else the
    CPU; also the CPU when the caller started a gloo process group itself (gloo carries CPU
    tensors: the tests run on CPU on a GPU machine this way)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_gpu())
    warn_cpu_only_torch()
    return torch.device("cpu")


def local_gpu() -> int:
    """LOCAL_RANK, checked against the GPUs this process sees: one GPU per process."""
    local, count = env_int("LOCAL_RANK", 0, low=0), torch.cuda.device_count()
    # Every process of the node checks its node's count, so all raise the same error (and rank
    # 0 prints it: run_main), not only the ones without a GPU.
    per_node = max(local + 1, env_int("LOCAL_WORLD_SIZE", 0, low=0))
    if per_node > count:
        raise SpecError(
            f"{per_node} processes on this node (LOCAL_WORLD_SIZE) and {count} GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): every "
            f"process needs its own GPU; start at most {count} per node (torchrun "
            f"--nproc_per_node={count}) with a strategy of dp*tp*pp = nodes x {count}, or run "
            "on CPU with CUDA_VISIBLE_DEVICES= (gloo)"
        )
    return local


def nvidia_gpus() -> int:
    """NVIDIA GPUs the driver lists (/proc/driver/nvidia/gpus), whatever torch was built for."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


_warned: list[bool] = []


def warn_cpu_only_torch() -> None:
    """Say once that this torch cannot use the NVIDIA GPUs the machine has (a CPU-only build)."""
    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    if _warned or gpu_build or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return
    gpus = nvidia_gpus()
    if gpus:
        _warned.append(True)
        print(
            f"warning: torch {torch.__version__} is a CPU-only build and this machine has {gpus} "
            "NVIDIA GPU(s): running on CPU. Install the CUDA build of the same torch from "
            "PyTorch's CUDA wheel index (pip install torch==<version> --index-url "
            "https://download.pytorch.org/whl/cu130) to use them",
            file=sys.stderr,
        )


def init_distributed() -> None:
    """Join the process group torchrun describes (NCCL on CUDA, gloo on CPU); no-op for one
    process."""
    if dist.is_initialized() or launched_world_size() == 1:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
        backend = "nccl"
    else:
        warn_cpu_only_torch()
        backend = "gloo"
    dist.init_process_group(backend)


def shutdown(code: int = 0) -> NoReturn:
    """Destroy the process group, flush, and exit without interpreter finalization (see module
    doc)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; the code says whether the run worked
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main: Callable[[], "int | None"]) -> NoReturn:
    """Run ``main()`` on every rank and exit cleanly with its status.

    A SpecError (a strategy that does not fit the world size, the model or the batch) is printed
    once, by rank 0, and every rank exits with status 2; any other exception prints its traceback
    and exits with status 1.

    Example::

        def main():
            engine = Engine(make_model, optimizer=make_optimizer, strategy="strategy.yaml")
            engine.fit(dataset, epochs=1)

        run_main(main)
    """
    try:
        code = main() or 0
    except SpecError as exc:
        if is_rank0():
            print(f"error: {exc}", file=sys.stderr)
        else:
            # Every rank raised the same error. torchrun kills the others as soon as one exits,
            # so the other ranks give rank 0 time to print it first.
            time.sleep(_SPEC_ERROR_GRACE_S)
        code = 2
    except BaseException:  # noqa: BLE001 - report, then exit with the process group torn down
        traceback.print_exc()
        code = 1
    shutdown(code)
