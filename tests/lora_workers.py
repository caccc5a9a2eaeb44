"""Multi-process LoRA runs for tests/test_lora_engine.py: gloo workers (torch.multiprocessing,
spawn) that train the tiny Llama of engine_workers with adapters and report their losses, and the
same run in one process for reference."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import engine_workers as W  # noqa: E402

LORA = {"rank": 4, "alpha": 8}
LR = 5e-2  # adapters start at B = 0: a larger step than W.LR so the loss falls visibly


def lora_spec(kind: str = "llama", targets=None):
    lora = {**LORA, **({"targets": targets} if targets is not None else {})}
    return W.MODELS[kind].scaled(lora=lora)


def make_model(kind: str = "llama", targets=None):
    """The reference transformer of `kind` with LoRA in its spec, or (``hf_llama``) a Hugging
    Face Llama of the same shape, whose adapters come from the Engine's `model_spec`."""
    from autosearch.models.transformer import Transformer

    torch.manual_seed(1234)
    return W.hf_model(kind) if W.is_hf(kind) else Transformer(lora_spec(kind, targets))


def lora_losses(strategy: str, kind: str = "llama", *, save: str | None = None) -> dict:
    """Losses of `W.STEPS` AdamW steps of the adapters, and what the optimizer holds."""
    from autosearch import Engine

    model = make_model(kind)
    engine = Engine(
        model,
        optimizer=lambda p: torch.optim.AdamW(p, lr=LR),
        strategy=strategy,
        seed=0,
        model_spec=lora_spec("llama") if W.is_hf(kind) else None,
    )
    loader = engine.dataloader(W.dataset(kind), mode="train", steps_per_epoch=W.STEPS)
    engine.prepare(mode="train")
    optimized = sum(  # this rank's elements (an FSDP2 DTensor's local shard)
        (p.to_local() if hasattr(p, "to_local") else p).numel()
        for o in engine.trainer_.optimizers
        for g in o.param_groups
        for p in g["params"]
    )
    losses = [engine.run(batch, mode="train")["loss"] for batch in loader]
    if save is not None:
        engine.save_adapters(save)
    return {"losses": losses, "optimized_local": optimized}


def job(cases: list[dict], save_root: str) -> dict:
    return {
        c["name"]: lora_losses(
            c["strategy"], c.get("kind", "llama"), save=os.path.join(save_root, c["name"])
        )
        for c in cases
    }


def _entry(rank: int, world: int, port: int, outdir: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from autosearch.engine.distributed import shutdown

    code = 0
    try:
        dist.init_process_group("gloo")
        result = job(*args)
    except BaseException:  # noqa: BLE001 - reported to the test through the result file
        result = {"error": traceback.format_exc()}
        code = 1
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    shutdown(code)


def launch(world: int, cases: list[dict], save_root: str, timeout_s: float = 300.0) -> list:
    """Run `job` on `world` gloo processes; each rank's result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(world, W._free_port(), outdir, (cases, save_root)),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"LoRA runs on {world} processes took over {timeout_s} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world):
            with open(os.path.join(outdir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        raise RuntimeError("\n".join(errors))
    return results
