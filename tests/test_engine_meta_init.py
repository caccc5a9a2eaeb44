"""Large models start without materialising on one device (``Engine(..., meta_init=True)``).

The model is built on the meta device, parallelized, and only this rank's shards are allocated
and initialised. Rank 0's peak resident memory during `prepare` of a 66 M-parameter model
(264 MB in fp32) under ZeRO-3 over every process must scale like 1/world size: at world 2 under
0.6x and at world 4 under 0.4x the world-1 figure (1/2 and 1/4 plus allocator and
DTensor/FSDP bookkeeping). Observed on this machine: 258, 129 and 66 MiB at world 1, 2 and 4.
Without meta_init every rank builds the whole model first: 263 MiB at world 2. A warm-up
`prepare` of a tiny model comes first in each process, so the fixed costs of first use (modules
imported, process groups of the mesh) are not counted as the model's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import engine_workers as W  # noqa: E402

pytestmark = pytest.mark.slow
MODEL_BYTES = W.BIG.n_params * 4


@pytest.fixture(scope="module")
def peaks():
    out = {world: W.launch(world, "setup_memory", True, timeout_s=300)[0] for world in (1, 2, 4)}
    out["full_world2"] = W.launch(2, "setup_memory", False, timeout_s=300)[0]
    for key, r in out.items():
        print(
            f"rank 0 setup peak, {key}: {r['setup_peak_bytes'] / 2**20:.0f} MiB, "
            f"{r['local_params'] / 1e6:.1f} M local parameters"
        )
    return out


def test_rank0_setup_memory_scales_with_one_over_world_size(peaks):
    one = peaks[1]["setup_peak_bytes"]
    assert one >= 0.9 * MODEL_BYTES  # the whole model is allocated once at world 1
    assert peaks[2]["setup_peak_bytes"] < 0.6 * one
    assert peaks[4]["setup_peak_bytes"] < 0.4 * one
    assert peaks[2]["local_params"] == pytest.approx(W.BIG.n_params / 2, rel=0.01)
    assert peaks[4]["local_params"] == pytest.approx(W.BIG.n_params / 4, rel=0.01)
    assert peaks["full_world2"]["setup_peak_bytes"] >= 0.9 * MODEL_BYTES  # without meta_init


def test_meta_initialised_engines_load_a_checkpoint_shard_by_shard(tmp_path):
    r0, r1 = W.launch(2, "meta_load", str(tmp_path))
    assert r0 == r1
    for name in ("zero3", "tp2_sp"):
        assert r0[f"{name}_loaded_eval"] == pytest.approx(r0["saved_eval"], abs=1e-5)
        assert (
            abs(r0[f"{name}_fresh_eval"] - r0["saved_eval"]) > 1e-3
        )  # the load changed the weights
