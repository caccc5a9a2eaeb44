"""Multi-process jobs of tests/test_engine_moe2.py, run in the gloo workers of `engine_workers`
as `moe_workers`' are (its jobs stay available)."""

from __future__ import annotations

import engine_workers as W
import moe_workers as M
import torch


def job_etp_checkpoint(workdir: str) -> dict:
    """Train 2 steps under dp2 x tp2 x ep2 x etp2 and save; engines of other layouts (dp4; etp
    1) load the checkpoint and must evaluate to the same loss: the experts' DTensors over
    (ep, tp) are whole weights in the checkpoint."""
    import os

    from autosearch import Engine
    from autosearch.engine import SyntheticTokens

    data = SyntheticTokens.for_model(W.MODELS["llama"], 16, seed=0)
    valid = SyntheticTokens.for_model(W.MODELS["llama"], 8, seed=7)
    batch = "micro_batch_size=2,global_batch_size=8,amp=fp32"

    def engine(strategy):
        return Engine(
            lambda: M.make_model("moe"),
            optimizer=lambda p: torch.optim.AdamW(p, lr=W.LR),
            strategy=strategy,
            seed=0,
        )

    e = engine(f"dp=2,tp=2,ep=2,etp=2,{batch}")
    e.fit(data, steps_per_epoch=2, verbose=0)
    e.save(os.path.join(workdir, "etp2"))
    out = {"saved": e.evaluate(valid, verbose=0)["loss"]}
    for name, strategy in (("dp4", f"dp=4,{batch}"), ("tp2_ep2", f"dp=2,tp=2,ep=2,{batch}")):
        other = engine(strategy)
        out[f"{name}_fresh"] = other.evaluate(valid, verbose=0)["loss"]
        other.load(os.path.join(workdir, "etp2"))
        out[name] = other.evaluate(valid, verbose=0)["loss"]
    return out


JOBS = {"etp_checkpoint": job_etp_checkpoint}


def _entry(*args) -> None:
    W.JOBS.update(M.JOBS)
    W.JOBS.update(JOBS)
    W._entry(*args)


def launch(world: int, job: str, *args, timeout_s: float = 300.0) -> list[dict]:
    """`engine_workers.launch` with this module's jobs."""
    entry = W._entry
    W._entry = _entry  # the spawned processes start here, then run engine_workers' entry
    try:
        return W.launch(world, job, *args, timeout_s=timeout_s)
    finally:
        W._entry = entry
