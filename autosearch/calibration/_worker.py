"""One calibration process: `python -m autosearch.calibration._worker PLAN.json OUT.json`,
alone or under torchrun (one per rank). Runs the suites the plan names and rank 0 writes the rows.

Ends with destroy_process_group + flush + os._exit: gloo worker threads can abort the interpreter
at exit otherwise (shared/notes/torch-on-this-machine.md, "crash at process exit").
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(plan_path: str, out_path: str) -> int:
    import torch
    import torch.distributed as dist

    from autosearch.calibration import microbench as mb

    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if plan["device"] == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(plan["threads"]))
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    timer = mb.Timer(
        device, budget_s=plan["budget_s"], min_reps=plan["min_reps"], max_reps=plan["max_reps"]
    )
    rows: list[dict] = []
    suites = plan["suites"]
    if "process_memory" in suites:
        (held,) = timer.agree_max([mb.process_memory_bytes(device)])
        rows.append({"kind": "process_memory", "op": "baseline", "bytes": held})
    if "launch" in suites:
        rows += mb.launch_overhead(timer)
    if "gemm" in suites:
        rows += mb.gemm(
            timer,
            precisions=plan["precisions"],
            shapes=[tuple(s) for s in plan["gemm_shapes"]],
            max_call_s=plan["max_call_s"],
        )
    if "fp8_gemm" in suites:
        rows += mb.fp8_gemm(
            timer, shapes=[tuple(s) for s in plan["gemm_shapes"]], max_call_s=plan["max_call_s"]
        )
    if "memory" in suites:
        rows += mb.memory(timer, array_bytes=plan["memory_array_bytes"])
    if "attention" in suites:
        rows += mb.attention(
            timer,
            precisions=plan["precisions"],
            configs=[tuple(c) for c in plan["attention_configs"]],
            max_call_s=plan["max_call_s"],
        )
    if "collectives" in suites and world > 1:
        rows += mb.collectives(
            timer,
            sizes_bytes=plan["collective_bytes"],
            ops=plan["collective_ops"],
            max_call_s=plan["max_call_s"],
        )
    for r in rows:
        r.update(
            world_size=world, threads=torch.get_num_threads() if device.type == "cpu" else None
        )
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(rows, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main(sys.argv[1], sys.argv[2])
    except BaseException:  # report, then leave without running interpreter finalizers
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
