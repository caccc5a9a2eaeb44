"""Mixture-of-experts in the Engine: the MoE layer of the reference transformer, its
load-balancing loss, and expert parallelism (all-to-all over gloo) under dp, tp, pp and ZeRO-3.

Every parallel run starts from the same seed and reads the same samples in the same order as a
single-process run with the same micro-batch size and global batch (tests/test_engine_parallel.py
explains the set-up); the losses of 3 AdamW steps must match within that file's fp32 tolerance
(2e-5 for the first two steps, 1e-3 over three). Routing is a discrete choice, so a parallel
error that moved a router logit across a top-k boundary would show as a jump, not as drift;
observed: at most 1e-6 (dp, ep, ep + ZeRO-3, pp; tables below). The load-balancing loss is
computed per sequence (`autosearch.engine.moe`), so it does not depend on how the sequences are
dealt to the dp ranks and micro-batches.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import moe_workers as M  # noqa: E402  (tests/ is on sys.path under pytest's rootdir conftest)

from autosearch import ModelSpec, SpecError, Strategy  # noqa: E402
from autosearch.engine.moe import MoE, ep_problems  # noqa: E402
from autosearch.transformer import Transformer  # noqa: E402

B = "micro_batch_size=2,global_batch_size=8,amp=fp32"
FP32 = (2e-5, 1e-3)  # tests/test_engine_parallel.py: (first two steps, all steps)

WORLD2 = {
    "dp2": (f"dp=2,{B}", "moe"),
    "ep2": (f"dp=2,ep=2,{B}", "moe"),
    "ep2_zero3": (f"dp=2,ep=2,zero_stage=3,{B}", "moe"),
    "ep2_sigmoid": (f"dp=2,ep=2,{B}", "moe_sigmoid"),
    "ep2_recompute_full": (f"dp=2,ep=2,recompute=full,{B}", "moe"),
    "pp2": (f"pp=2,{B}", "moe"),
    "ep2_meta_init": (f"dp=2,ep=2,{B}", "moe_meta"),  # built on the meta device, then sliced
}
WORLD4 = {
    "dp4_ep2": (f"dp=4,ep=2,{B}", "moe"),
    "dp4_ep4_zero2": (f"dp=4,ep=4,zero_stage=2,{B}", "moe"),
    "dp2_tp2_ep2": (f"dp=2,tp=2,ep=2,{B}", "moe"),
    "dp2_tp2_ep2_sp_zero3": (f"dp=2,tp=2,ep=2,sequence_parallel=true,zero_stage=3,{B}", "moe"),
    "pp2_dp2_ep2": (f"pp=2,dp=2,ep=2,{B}", "moe"),
    "pp2_dp2_ep2_zero3": (f"pp=2,dp=2,ep=2,zero_stage=3,{B}", "moe"),
}


def _cases(table):
    return [
        dict(name=n, strategy=s, model=m.removesuffix("_meta"), meta=m.endswith("_meta"))
        for n, (s, m) in table.items()
    ]


@pytest.fixture(scope="module")
def references():
    torch.set_num_threads(1)
    refs = {kind: M.train_losses(B, kind) for kind in ("moe", "moe_sigmoid")}
    refs["moe_meta"] = M.train_losses(B, "moe", meta_init=True)
    return refs


@pytest.fixture(scope="module")
def world2():
    return M.launch(2, "moe_equivalence", _cases(WORLD2))


@pytest.fixture(scope="module")
def world4():
    return M.launch(4, "moe_equivalence", _cases(WORLD4), timeout_s=420)


def _check(results, table, name, references):
    model = table[name][1]
    ref = references[model]["loss"]
    got = results[0][name]["loss"]
    assert all(r[name]["loss"] == got for r in results), f"{name}: ranks report different losses"
    assert got[-1] < got[0] - 0.05, f"{name}: the loss did not fall ({got})"
    early = max(abs(a - b) for a, b in zip(got[:2], ref[:2]))
    gap = max(abs(a - b) for a, b in zip(got, ref))
    assert early <= FP32[0] and gap <= FP32[1], (
        f"{name}: losses {got} differ from single-process {ref} by {early:.2e} in the first"
        f" two steps and {gap:.2e} overall"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_matches_single_process(world2, references, name):
    _check(world2, WORLD2, name, references)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_matches_single_process(world4, references, name):
    _check(world4, WORLD4, name, references)
