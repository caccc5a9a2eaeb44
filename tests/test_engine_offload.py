"""Offload to host memory in the Engine (issue 36), on CPU with gloo: each run trains 3 AdamW
steps from the seed and data order of a single-process run (tests/engine_workers.py) and must
give its losses.

* activation offload (``torch.autograd.graph.save_on_cpu`` around each block) copies the saved
  tensors and hands them back unchanged: EXACT (bitwise), in one process and over dp;
* parameter and optimizer offload (FSDP2's ``CPUOffloadPolicy``: shards, gradients and the
  AdamW step on the CPU) reorders fp32 sums as ZeRO-3 does: the FP32 tolerance of
  test_engine_parallel.py (2e-5 over the first two steps, 1e-3 over three);
* optimizer offload alone on a CPU device is the plain optimizer (its states are in host memory
  already; on a GPU the Engine steps torchao's CPUOffloadOptimizer): EXACT.

What a CPU cannot show: device memory freed. Here the device is the host, so what offload moves
stays in the same memory; the GPU check is left to a machine with one.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import engine_workers as W  # noqa: E402

from autosearch.core.errors import SpecError  # noqa: E402

B = "micro_batch_size=2,global_batch_size=8,amp=fp32"
EXACT, FP32 = 0.0, (2e-5, 1e-3)


@pytest.fixture(scope="module")
def reference():
    return W.reference_losses(B, "llama")


@pytest.mark.parametrize(
    "extra",
    [
        "offload_activations=layers",
        "offload_activations=layers,recompute=full",
        "offload_optimizer=true",
    ],
)
def test_one_process_offload_gives_the_same_losses(reference, extra):
    got = W.train_losses(f"{B},{extra}", "llama")
    assert got == reference, f"{extra}: {got} vs {reference}"


def test_offload_runs_around_compiled_blocks():
    """save_on_cpu is entered around each block's call, outside its compiled region (Dynamo
    does not trace it): the same losses as the compiled run without offload, bitwise."""
    compiled = f"{B},compile=true"
    assert W.train_losses(f"{compiled},offload_activations=layers", "llama") == W.train_losses(
        compiled, "llama"
    )


# name: (strategy, tolerance)
WORLD2 = {
    "dp2_zero3_offload_states": (
        f"dp=2,zero_stage=3,offload_optimizer=true,offload_params=true,{B}",
        FP32,
    ),
    "dp2_zero3_offload_all": (
        f"dp=2,zero_stage=3,offload_optimizer=true,offload_params=true,"
        f"offload_activations=layers,{B}",
        FP32,
    ),
    "dp2_offload_activations": (f"dp=2,offload_activations=layers,{B}", FP32),
}


@pytest.fixture(scope="module")
def world2():
    cases = [dict(name=n, strategy=v[0], model="llama") for n, v in WORLD2.items()]
    return W.launch(2, "equivalence", cases, timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_offload_matches_single_process(world2, reference, name):
    _, tol = WORLD2[name]
    got = world2[0][name]
    assert all(r[name] == got for r in world2), f"{name}: ranks report different losses"
    assert got[-1] < got[0] - 0.05, f"{name}: the loss did not fall ({got})"
    early = max(abs(a - b) for a, b in zip(got[:2], reference[:2]))
    gap = max(abs(a - b) for a, b in zip(got, reference))
    print(f"{name}: max loss difference {gap:.2e}")
    assert early <= tol[0] and gap <= tol[1], f"{name}: {got} vs single-process {reference}"


def test_parameter_offload_without_fsdp_is_refused():
    with pytest.raises(SpecError, match="offload_params runs through FSDP2's CPUOffloadPolicy"):
        W.train_losses(f"{B},zero_stage=3,offload_optimizer=true,offload_params=true", "llama")
