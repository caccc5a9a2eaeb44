"""The cost model's terms read exactly the Strategy fields they declare (their READS), and the
caches of AnalyticCostModel, keyed by those declarations, never return a stale result."""

import dataclasses
import itertools

import pytest

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.core.bands import kind_of
from autosearch.core.runtime import RUNTIMES
from cost_models import AnalyticCostModel
from cost_models.analytic import BAND_READS, LAYER_READS
from cost_models.terms import (
    compute,
    context_parallel,
    data_parallel,
    fields_read,
    memory,
    offload,
    pipeline,
    reads,
    tensor_parallel,
)

FIELDS = tuple(f.name for f in dataclasses.fields(Strategy))
MODEL = ModelSpec.load("llama3-8b")  # 32 layers, 32 heads, 8 kv heads
CLUSTER = Cluster.parse("h100-sxm:4x8")


class Recorder:
    """A strategy that records which of its fields are read, also those read by its properties
    (`grad_accum_steps`, ...) and methods (`layers_per_chunk`), which run on the recorder."""

    def __init__(self, strategy: Strategy):
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        if name in FIELDS:
            self.read.add(name)
            return getattr(self._strategy, name)
        attr = getattr(Strategy, name)
        return attr.fget(self) if isinstance(attr, property) else attr.__get__(self)

    def __setattr__(self, name, value):
        raise AttributeError(f"a term set {name} on its strategy")


# Strategies that between them take every branch of every term (flash and plain attention come
# from the runtimes: megatron-sc21 has no flash attention).
CASES = [
    Strategy(dp=32, global_batch_size=64, zero_stage=z, amp=amp)
    for z, amp in ((0, "bf16"), (1, "fp16"), (2, "bf16"), (3, "fp32"))
] + [
    Strategy(
        dp=2,
        tp=4,
        pp=4,
        micro_batch_size=2,
        global_batch_size=64,
        sequence_parallel=True,
        recompute="selective",
        zero_stage=1,
    ),
    Strategy(
        dp=2,
        tp=2,
        pp=4,
        global_batch_size=64,
        pipeline_schedule="interleaved_1f1b",
        virtual_stages=2,
        recompute="full",
        recompute_num_layers=1,
        zero_stage=3,
    ),
    Strategy(
        dp=2,
        tp=2,
        pp=2,
        cp=4,
        global_batch_size=32,
        pipeline_schedule="gpipe",
        pipeline_split=(15, 17),
        recompute="selective_op",
        fp8="tensorwise",
        compile=True,
        async_tp=True,
        zero_stage=3,
    ),
    Strategy(dp=4, tp=8, global_batch_size=64, fp8="rowwise", recompute="full", zero_stage=2),
    Strategy(dp=8, cp=4, global_batch_size=64, recompute="selective_op", zero_stage=3),
    # offload to host memory: the optimizer and the ZeRO-3 parameter shards on the host
    Strategy(
        dp=2,
        pp=2,
        tp=8,
        global_batch_size=64,
        zero_stage=3,
        offload_optimizer=True,
        offload_params=True,
        offload_activations="layers",
    ),
]
RUNTIME_NAMES = tuple(RUNTIMES)


def _ctx(cm, s):
    return (cm._context,)


def _micro(cm, s):
    return pipeline.microbatch(s, cm._context, cm._layer(s), cm._ranks(s))


def _attention(cm, s):
    c = compute.layer(s, cm._context)
    return c.attention_fwd_s, c.attention_bwd_s


def _params(cm, s):
    return memory.stage_params(s, cm._context, cm._ranks(s))


# Every term, with its inputs besides the strategy (computed from the strategy itself).
TERMS = {
    compute.layer: _ctx,
    compute.optimizer_step_s: lambda cm, s: (cm._context, _params(cm, s).total),
    compute.autocast_casts_s: lambda cm, s: (
        cm._context,
        _params(cm, s).total,
        None,
        (max(cm._ranks(s)), 0.0),
    ),
    compute.recompute_repeats: lambda cm, s: (cm._layer(s),),
    compute.recomputed_layers: lambda cm, s: (max(cm._ranks(s)),),
    tensor_parallel.layer_comm: _ctx,
    context_parallel.layer_comm: lambda cm, s: (cm._context, *_attention(cm, s)),
    context_parallel.attention_backward_bytes: _ctx,
    pipeline.rank_layers: _ctx,
    pipeline.microbatch: lambda cm, s: (cm._context, cm._layer(s), cm._ranks(s)),
    pipeline.bubble_s: lambda cm, s: (_micro(cm, s).total_s,),
    memory.stage_params: lambda cm, s: (cm._context, cm._ranks(s)),
    memory.layer_activations: _ctx,
    memory.activation_peak_bytes: lambda cm, s: (cm._context, cm._ranks(s), cm._activations(s)),
    data_parallel.cost: lambda cm, s: (
        cm._context,
        _params(cm, s),
        cm._ranks(s),
        cm._layer(s),
        _micro(cm, s).recompute_layer_s,
    ),
    offload.cost: lambda cm, s: (
        cm._context,
        data_parallel.cost(
            s,
            cm._context,
            _params(cm, s),
            cm._ranks(s),
            cm._layer(s),
            _micro(cm, s).recompute_layer_s,
        ),
        compute.optimizer_step_s(s, cm._context, _params(cm, s).total),
        _params(cm, s).total / (s.dp * s.cp),
        cm._ranks(s),
        cm._layer(s),
        _micro(cm, s).recompute_layer_s,
        memory.activation_peak_bytes(s, cm._context, cm._ranks(s), cm._activations(s)),
        cm._activations(s).kept_bytes,
    ),
}


def test_every_term_is_checked():
    modules = (
        compute,
        tensor_parallel,
        context_parallel,
        pipeline,
        memory,
        data_parallel,
        offload,
    )
    declared = {f for m in modules for f in vars(m).values() if hasattr(f, "READS")}
    assert declared == set(TERMS)


def fields_each_reads(run, strategies) -> list[set[str]]:
    """The fields `run(strategy, recorder)` reads, for each strategy, with the same result as on
    the strategy itself."""
    out = []
    for s in strategies:
        x = Recorder(s)
        assert run(s, x) == run(s, s)
        out.append(x.read)
    return out


def undeclared_and_unread(declared, read_sets) -> tuple[set[str], set[str]]:
    read = set().union(*read_sets)
    return read - set(declared), set(declared) - read


@pytest.mark.parametrize(
    "term", TERMS, ids=lambda t: f"{t.__module__.split('.')[-1]}.{t.__name__}"
)
def test_each_term_reads_exactly_the_fields_it_declares(term):
    """Every field a term reads, over strategies and runtimes that take each of its branches."""
    read_sets = []
    for runtime in RUNTIME_NAMES:
        cm = AnalyticCostModel(MODEL, CLUSTER, runtime=runtime)
        read_sets += fields_each_reads(lambda s, x, cm=cm: term(x, *TERMS[term](cm, s)), CASES)
    undeclared, unread = undeclared_and_unread(term.READS, read_sets)
    assert not undeclared, (
        f"{term.__qualname__} reads {sorted(undeclared)} but does not declare them"
    )
    # a field declared but never read keys a cache needlessly (or a case is missing here)
    assert not unread, f"{term.__qualname__} declares {sorted(unread)} but never reads them"
    assert set(term.READS) <= set(FIELDS)


def test_the_check_catches_an_undeclared_read():
    @reads("tp")
    def term(s, ctx):
        return s.tp * s.grad_accum_steps  # reads dp, micro_batch_size, global_batch_size too

    read_sets = fields_each_reads(lambda s, x: term(x, None), CASES[:2])
    undeclared, unread = undeclared_and_unread(term.READS, read_sets)
    assert undeclared == {"dp", "micro_batch_size", "global_batch_size"} and not unread


def test_cache_keys_are_the_fields_their_terms_read():
    """The layer cache composes compute, tensor and context parallel; the band cache is keyed by
    what `kind_of` reads."""
    cm = AnalyticCostModel(MODEL, CLUSTER, runtime="torchtitan")
    layer_terms = (compute.layer, tensor_parallel.layer_comm, context_parallel.layer_comm)
    assert cm._layer.fields == LAYER_READS == fields_read(*layer_terms)
    read = fields_each_reads(lambda s, x: cm._compose_layer(x), CASES)
    assert set().union(*read) == set(LAYER_READS)
    assert cm._ranks.fields == pipeline.rank_layers.READS
    assert cm._activations.fields == memory.layer_activations.READS
    assert cm._params.fields == fields_read(memory.stage_params, pipeline.rank_layers)
    read = fields_each_reads(lambda s, x: kind_of(x, CLUSTER, "torch"), CASES)
    assert set().union(*read) == set(BAND_READS)


# Values each field takes in the variants below (invalid combinations are skipped).
VALUES = {
    "dp": (1, 2, 4, 8),
    "tp": (1, 2, 8),
    "pp": (1, 2, 4),
    "micro_batch_size": (1, 2),
    "global_batch_size": (32, 64),
    "pipeline_schedule": ("gpipe", "1f1b", "interleaved_1f1b"),
    "virtual_stages": (1, 2, 3),
    "recompute": ("none", "selective", "selective_op", "full"),
    "sequence_parallel": (False, True),
    "zero_stage": (0, 1, 2, 3),
    "amp": ("fp32", "fp16", "bf16"),
    "cp": (1, 2),
    "recompute_num_layers": (None, 1, 3),
    "pipeline_split": (None, (7, 9, 9, 7), (15, 17)),
    "fp8": ("none", "tensorwise", "rowwise"),
    "compile": (False, True),
    "async_tp": (False, True),
    # ep and etp are read by the expert terms (a MoE model below); a dense model's must not move
    "ep": (1, 2),
    "etp": (1, 2),
    # Megatron's per-module recompute, priced for MoE models (Mixtral below)
    "recompute_modules": ("none", "layernorm+moe_act", "layernorm+moe"),
    # offload to host memory (cost_models/terms/offload.py); offload_params needs the ZeRO-3
    # case below that offloads its optimizer
    "offload_optimizer": (False, True),
    "offload_params": (False, True),
    "offload_activations": ("none", "layers"),
}
DEGREES = ("dp", "tp", "pp", "cp")


def variants(base: Strategy):
    """(field, strategy) for strategies that differ from `base` in `field` (and, to stay valid,
    in what it needs: a changed degree takes its ranks from another degree, virtual stages come
    with the interleaved schedule, N-layer recompute with full recompute)."""
    for name, values in VALUES.items():
        for value in values:
            if value == getattr(base, name):
                continue
            changes = {name: value}
            if name in DEGREES:  # keep the world size: rebalance dp (or tp when dp changes)
                other = "tp" if name == "dp" else "dp"
                rest = 1
                for d in DEGREES:
                    rest *= changes.get(d, getattr(base, d)) if d != other else 1
                changes[other] = max(1, base.world_size // rest)
            if name == "virtual_stages":
                changes["pipeline_schedule"] = "interleaved_1f1b" if value > 1 else "1f1b"
            if name == "recompute_num_layers" and value is not None:
                changes["recompute"] = "full"
            try:
                yield name, base.replace(**changes)
            except ValueError:
                continue


def test_a_warm_model_gives_what_a_fresh_one_gives():
    """Strategies that differ from one already estimated in one field: the warm model (its
    caches hold the first) scores each exactly as a fresh model does. A cache key that forgets a
    field the numbers depend on fails here."""
    assert set(VALUES) == set(FIELDS)
    varied = set()
    # 126 layers: the interleaved pipeline moves a layer between ranks (31/32/32/31 or 32/31/31/32)
    # Mixtral 8x7B: the expert terms' caches (ep, etp) are checked as the others
    models = (MODEL, ModelSpec.load("llama3.1-405b"), ModelSpec.load("mixtral-8x7b"))
    for model, runtime in itertools.product(models, RUNTIME_NAMES):
        warm = AnalyticCostModel(model, CLUSTER, runtime=runtime)
        for base in CASES:
            for name, variant in variants(base):
                fresh = AnalyticCostModel(model, CLUSTER, runtime=runtime)
                try:  # valid for this model, cluster and runtime?
                    expected = fresh.estimate(variant)
                except ValueError:
                    if name not in ("ep", "etp", "recompute_modules"):  # (dense: unvalidated)
                        continue
                    expected = fresh.estimate(variant, validate=False)
                warm.estimate(base, validate=False)  # the caches hold the base
                assert warm.estimate(variant, validate=False) == expected, (runtime, variant)
                varied.add(name)
    assert varied == set(FIELDS)  # every field was varied at least once
