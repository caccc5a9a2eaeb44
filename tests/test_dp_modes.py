"""The data-parallel mode table (autosearch/core/dp_modes.py) ties the Engine to the cost model:
both must do exactly what the table says, for every ZeRO stage and parallel layout."""

from __future__ import annotations

import itertools
import pathlib

import pytest

from autosearch import Cluster
from autosearch.core import ModelSpec, RuntimeOptions, SpecError, Strategy, dp_mode
from autosearch.core.dp_modes import markdown_table
from cost_models import AnalyticCostModel

COMBOS = list(itertools.product((0, 1, 2, 3), (1, 2), (1, 2), (1, 2)))  # zero, dp, tp, pp


@pytest.mark.parametrize("zero,dp,tp,pp", COMBOS)
def test_table_is_consistent(zero, dp, tp, pp):
    mode = dp_mode(zero_stage=zero, dp=dp, tp=tp, pp=pp)
    if dp == 1:
        assert mode.name == "none" and mode.wrapper == "none"
        return
    assert mode.shards_optimizer == (zero >= 1)
    assert mode.reshard_after_forward == (zero == 3)
    assert mode.zero_redundancy_optimizer == (mode.name == "ddp_zero1")
    # DDP cannot take DTensor (tp) nor run inside pipelining (pp): FSDP2 there.
    assert mode.wrapper == ("ddp" if zero <= 1 and tp == pp == 1 else "fsdp")
    # Pipelining reduces once per step; so do DDP and ZeRO-1.
    assert mode.reduce_every_microbatch == (zero >= 2 and pp == 1)
    if mode.shards_params:
        assert mode.grads_accumulate_unsharded != mode.reduce_every_microbatch


def test_bad_arguments_are_spec_errors():
    with pytest.raises(SpecError, match="zero_stage"):
        dp_mode(zero_stage=4, dp=2)
    with pytest.raises(SpecError, match="dp must be a positive integer"):
        dp_mode(zero_stage=0, dp=0)


def test_docs_carry_the_table():
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "engine.md").read_text(encoding="utf-8")
    assert markdown_table() in docs, (
        "docs/engine.md is stale: paste `python -m autosearch.core.dp_modes`"
    )


# ---- the Engine builds what the table says ------------------------------------------------------
@pytest.mark.parametrize("zero,dp,tp,pp", [c for c in COMBOS if c[1] > 1])
@pytest.mark.parametrize("amp", ["fp32", "bf16"])
def test_engine_applies_the_table(zero, dp, tp, pp, amp, monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.distributed.fsdp as fsdp
    import torch.nn.parallel as parallel

    from autosearch.distributed.plan import ParallelPlan
    from autosearch.engine.parallel_dims import ParallelDims
    from autosearch.engine.parallelize import apply_data_parallel

    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append(("fsdp", kw)))
    monkeypatch.setattr(
        parallel,
        "DistributedDataParallel",
        lambda module, **kw: calls.append(("ddp", kw)) or module,
    )

    class Mesh:  # records which sub-mesh FSDP2 gets
        def __getitem__(self, names):
            return names

        def get_group(self, name):
            return name

    model = torch.nn.Sequential()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    dims = ParallelDims.of(dp=dp, tp=tp, pp=pp, zero_stage=zero)
    mode = dp_mode(zero_stage=zero, dp=dp, tp=tp, pp=pp)
    apply_data_parallel(
        model, dims, Mesh(), ParallelPlan(blocks="layers"), amp, torch.device("cpu")
    )

    assert {kind for kind, _ in calls} == {mode.wrapper}
    if mode.wrapper == "fsdp":
        assert len(calls) == 3  # each block, then the root
        for _, kw in calls:
            assert kw["reshard_after_forward"] == mode.reshard_after_forward
            assert kw["mesh"] == (("dp", "dp_shard") if mode.hsdp_replicate else "dp")
            cast = kw["mp_policy"].param_dtype is not None
            assert cast == (mode.mixed_precision_policy and amp != "fp32")


# ---- the cost model charges what the table says -------------------------------------------------
SPEC = ModelSpec(name="t", n_layers=4, hidden_size=512, n_heads=8, vocab_size=1024, seq_len=256)
NO_OVERLAP = RuntimeOptions(name="no-overlap", dp_overlap=0.0)


def _report(zero, dp, tp, pp, m, *, runtime=NO_OVERLAP):
    cluster = Cluster(gpu="h100-sxm", n_nodes=1, gpus_per_node=dp * tp * pp)
    model = AnalyticCostModel(SPEC, cluster, runtime=runtime)
    strategy = Strategy(
        dp=dp,
        tp=tp,
        pp=pp,
        micro_batch_size=1,
        global_batch_size=dp * m,
        zero_stage=zero,
        amp="fp32",
    )
    return model.estimate(strategy)


@pytest.mark.parametrize("zero,tp,pp", list(itertools.product((0, 1, 2, 3), (1, 2), (1, 2))))
def test_cost_model_memory_follows_the_table(zero, tp, pp):
    mode = dp_mode(zero_stage=zero, dp=2, tp=tp, pp=pp)
    single, double = _report(zero, 1, tp, pp, 4).memory, _report(zero, 2, tp, pp, 4).memory
    assert double.optimizer_bytes / single.optimizer_bytes == pytest.approx(
        0.5 if mode.shards_optimizer else 1.0
    )
    grads_sharded = mode.shards_grads and not mode.grads_accumulate_unsharded  # m = 4 > 1
    assert double.grads_bytes / single.grads_bytes == pytest.approx(0.5 if grads_sharded else 1.0)
    whole = single.params_bytes  # fp32 parameters of the stage, nothing to shard with dp = 1
    if mode.shards_params:  # a shard, plus what FSDP2 holds gathered at the peak
        two_layers = 2 * SPEC.layer_params / tp * 4
        gathered = two_layers if (mode.reshard_after_forward and pp == 1) else whole
        assert double.params_bytes == pytest.approx(whole / 2 + gathered)
    else:
        assert double.params_bytes == pytest.approx(whole)


@pytest.mark.parametrize("zero,tp,pp", list(itertools.product((0, 1, 2, 3), (1, 2), (1, 2))))
def test_cost_model_collectives_follow_the_table(zero, tp, pp):
    """With no overlap and fp32 (gathers and reduce-scatters move the same bytes at the same rate
    on NVLink), the data-parallel time counts collectives: from 2 to 4 micro-batches it grows
    exactly as the table's per-micro-batch collectives say."""
    mode = dp_mode(zero_stage=zero, dp=2, tp=tp, pp=pp)

    def count(m):
        if not mode.shards_params:
            return 1.0  # one all-reduce (plus one broadcast for ZeRO-1: also once per step)
        gathers = (m if mode.gathers_every_microbatch else 1) + (
            m if mode.reshard_after_forward else 0
        )
        return gathers + (m if mode.reduce_every_microbatch else 1)

    t2 = _report(zero, 2, tp, pp, 2).time.dp_comm_exposed_s
    t4 = _report(zero, 2, tp, pp, 4).time.dp_comm_exposed_s
    assert t2 > 0
    assert t4 / t2 == pytest.approx(count(4) / count(2), rel=1e-9)
