"""The dimension registry: every list of strategy dimensions is derived from it, so a dimension
declared there reaches Strategy, its files and labels, the space, the stored trial, the ranking,
the bands, the sweep and the runtimes' checks, and one declared nowhere else fails at import."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from autosearch import Cluster, ModelSpec, SpecError, Strategy
from autosearch.core import dimensions, rules
from autosearch.core.bands import kind_of
from autosearch.core.runtime import RUNTIMES, RuntimeOptions
from autosearch.core.strategy import FILE_FIELDS
from autosearch.tuning._params import PLAIN_DIMENSIONS
from autosearch.tuning._ranking import n_parallel_axes
from autosearch.tuning._sweep import COLUMNS
from search_spaces import LAYOUT_FIELDS, SearchSpace, SpaceConfig

EVERYTHING = Strategy(
    dp=2,
    tp=2,
    pp=2,
    cp=2,
    micro_batch_size=2,
    global_batch_size=64,
    pipeline_schedule="interleaved_1f1b",
    virtual_stages=2,
    recompute="full",
    recompute_num_layers=1,
    sequence_parallel=True,
    zero_stage=1,
    amp="bf16",
    fp8="rowwise",
    compile=True,
    async_tp=True,
)


def test_strategy_declares_exactly_the_registry():
    fields = {f.name: f.default for f in dataclasses.fields(Strategy)}
    assert list(fields) == sorted(fields, key=list(fields).index)  # (file order)
    assert set(fields) == set(dimensions.NAMES)
    assert all(fields[d.name] == d.default for d in dimensions.DIMENSIONS)


def test_a_dimension_declared_in_one_place_only_fails_at_import():
    @dataclasses.dataclass(frozen=True)
    class Partial:
        dp: int = 1

    with pytest.raises(TypeError, match="missing .*'tp'"):
        dimensions.check_fields(Partial)

    @dataclasses.dataclass(frozen=True)
    class Extra(Strategy):
        warp_drive: int = 1

    with pytest.raises(TypeError, match="undeclared \\[.warp_drive.\\]"):
        dimensions.check_fields(Extra)


def test_rules_read_declared_dimensions_and_compose_problems():
    for rule in rules.RULES:
        assert set(rule.reads) <= set(dimensions.NAMES), rule.name
    assert len({r.name for r in rules.RULES}) == len(rules.RULES)
    bad = Strategy(dp=3, tp=2, micro_batch_size=2, global_batch_size=8, async_tp=True)
    got = bad.problems(None, Cluster.parse("h100-sxm:1x8"))
    assert got == rules.problems(bad.__dict__, None, Cluster.parse("h100-sxm:1x8"))
    assert any("dp*tp*pp = 3*2*1 = 6" in p for p in got)
    assert any("does not split into dp*micro_batch_size" in p for p in got)


def test_every_consumer_lists_the_registry():
    # files, plain names, sweep columns, space keys, layouts
    assert FILE_FIELDS == tuple(d.name for d in dimensions.DIMENSIONS if d.file)
    assert PLAIN_DIMENSIONS == dimensions.PLAIN_NAMES
    assert {"pipeline"} | set(PLAIN_DIMENSIONS) >= {
        d.plain for d in dimensions.DIMENSIONS if d.plain
    }
    assert set(COLUMNS) >= set(dimensions.NAMES)
    assert set(SpaceConfig.KEYS) >= {d.name for d in dimensions.DIMENSIONS if d.searched}
    assert set(LAYOUT_FIELDS) == {
        d.name
        for d in dimensions.DIMENSIONS
        if d.level in (dimensions.REST, dimensions.MESH, dimensions.FOLDED, dimensions.LAYOUT)
    }
    # every runtime's `supports` names a declared feature, or a kind of block it trains
    from autosearch.core.runtime import MODEL_FEATURES

    for runtime in RUNTIMES.values():
        known = set(dimensions.feature_names()) | set(MODEL_FEATURES)
        assert set(runtime.supports) <= known, runtime.name


def test_labels_features_axes_and_bands_follow_the_registry():
    s = EVERYTHING
    assert s.short() == (
        "dp2-tp2-pp2-cp2-mb2-gbs64-interleaved_1f1bv2-rc-full1-sp-z1-bf16-fp8rowwise-compile"
        "-asynctp"
    )
    assert set(dimensions.features_used(s)) == {
        "cp",
        "fp8",
        "compile",
        "async_tp",
        "recompute_num_layers",
    }
    assert n_parallel_axes(s) == 4
    assert kind_of(s, Cluster.parse("h100-sxm:2x8"), "torch")["axes"] == "dp+tp+pp+cp"
    assert kind_of(Strategy(dp=1), Cluster.parse("h100-sxm:1x1"), "torch")["axes"] == "single"
    lacks = RuntimeOptions.get("megatron-sc21").lacks(s)
    assert any("cp=2 (context parallel)" in m for m in lacks)


def test_a_runtime_that_supports_an_undeclared_feature_is_refused():
    with pytest.raises(SpecError, match="which no dimension or kind of block declares"):
        RuntimeOptions.from_dict({"name": "x", "supports": ["warp_drive"]}, what="runtime 'x'")


def test_the_tree_levels_are_the_registry_mesh_levels():
    space = SearchSpace("llama3-8b", "h100-sxm:2x8", global_batch_size=64, cp=[1, 2])
    assert dimensions.MESH_LEVELS == ("tp", "cp", "pp")
    layouts = list(space.layouts())
    assert {lay.cp for lay in layouts} == {1, 2}
    assert all(lay.dp * lay.tp * lay.pp * lay.cp == space.cluster.world_size for lay in layouts)
    assert layouts[0].label().startswith("dp")


def test_an_axis_pinned_to_values_no_layout_can_take_empties_the_space_and_says_why():
    # fp8 on a GPU without fp8 units used to fall back to none without a word
    with pytest.raises(SpecError, match="fp8 \\['tensorwise'\\] is not allowed.*no fp8 peak"):
        SearchSpace("llama3-8b", "a100-sxm4-80gb:1x8", global_batch_size=64, fp8="tensorwise")
    # async TP pinned on: only the layouts with tp > 1 remain
    space = SearchSpace("llama3-8b", "h100-sxm:1x8", global_batch_size=64, async_tp=True)
    assert all(s.tp > 1 and s.async_tp for s in space.enumerate())


def test_parallel_dims_take_every_mesh_degree():
    pytest.importorskip("torch")
    from autosearch.engine.parallel_dims import ParallelDims

    dims = ParallelDims.from_strategy(Strategy(dp=2, cp=2, tp=2, global_batch_size=2), 8)
    assert (dims.dp, dims.tp, dims.pp, dims.cp) == (2, 2, 1, 2)
    # (dp with tp and no ZeRO replicates: HSDP's size-1 shard dim follows dp)
    assert dims.mesh_shape == ((1, 2, 1, 2, 2), ("pp", "dp", "dp_shard", "cp", "tp"))
    assert ParallelDims.of(dp=4, tp=2, zero_stage=3).mesh_shape == ((1, 4, 2), ("pp", "dp", "tp"))
    # the product the message names is the one that is wrong: cp included
    with pytest.raises(SpecError, match="dp\\*tp\\*pp\\*cp = 8\\*1\\*1\\*2 = 16 processes"):
        ParallelDims.from_strategy(Strategy(dp=8, cp=2), 8)


def test_a_folded_degree_splits_the_ranks_it_folds_and_adds_no_devices():
    """ep (Megatron-Core's parallel folding) is a tree level below the mesh degrees: for Mixtral
    8x7B (8 routed experts) it takes every divisor of tp * dp * cp / etp that divides 8, and the
    world stays dp * tp * pp * cp; a dense model keeps ep = etp = 1 and its space is unchanged."""
    dense = SearchSpace("llama3-8b", "h100-sxm:2x8", global_batch_size=64)
    assert {s.ep for s in dense.enumerate()} == {1}
    # Megatron-Core's space: ep and etp open, ep groups over any of the tp x dp x cp ranks
    moe = SearchSpace(
        "mixtral-8x7b", "h100-sxm:2x8", global_batch_size=64, runtime="megatron-core"
    )
    assert moe.model.moe.n_experts == 8
    for lay in moe.layouts():
        assert (lay.tp * lay.dp * lay.cp) % (lay.ep * lay.etp) == 0 and 8 % lay.ep == 0
        assert lay.tp % lay.etp == 0
        assert lay.dp * lay.tp * lay.pp * lay.cp == 16
    assert {lay.ep for lay in moe.layouts() if lay.dp == 16} == {1, 2, 4, 8}
    # etp < tp lets an ep group take ranks attention splits by tp (tp2 x dp4: ep up to 8)
    assert {
        lay.ep
        for lay in moe.layouts()
        if lay.dp == 4 and lay.tp == 2 and lay.cp == 1 and lay.etp == 1
    } == {
        1,
        2,
        4,
        8,
    }
    assert {
        lay.ep
        for lay in moe.layouts()
        if lay.dp == 4 and lay.tp == 2 and lay.cp == 1 and lay.etp == 2
    } == {
        1,
        2,
        4,
    }
    assert "ep" in moe.plain_choices() and "(dp, tp, pp, cp, ep, etp) splits" in moe.describe()
    for s in itertools.islice(moe.enumerate(), 0, None, 97):
        assert s.validate(moe.model, moe.cluster) is s
        assert moe.params_of(s) is not None


def test_a_declared_export_reaches_every_exporter():
    """ep's Megatron flag and torchtitan key are data in the registry (`Dimension.exports`), and
    DeepSpeed says why it has none: no exporter names ep."""
    from autosearch.export import export

    s = Strategy(dp=8, ep=4, global_batch_size=64)
    model = ModelSpec.load("mixtral-8x7b")
    assert "--expert-model-parallel-size 4" in export(s, to="megatron", model=model).text
    assert "expert_parallel_degree = 4" in export(s, to="torchtitan", model=model).text
    deepspeed = export(s, to="deepspeed", model=model)
    assert [field for field, _ in deepspeed.unsupported] == ["ep"]
    for to in ("megatron", "torchtitan", "deepspeed"):  # ep=1 says nothing and maps
        plain = export(Strategy(dp=8, global_batch_size=64), to=to, model=model)
        assert "ep" in plain.mapped and "expert_parallel" not in plain.text


def test_expert_parallel_rules_say_what_to_do():
    dense = Strategy(dp=8, ep=2, global_batch_size=8)
    assert any(
        "needs a mixture-of-experts model" in p
        for p in dense.problems(ModelSpec.load("llama3-8b"))
    )
    assert any("must divide tp*dp*cp = 1*2*1" in p for p in Strategy(dp=2, ep=4).problems())
    assert not Strategy(dp=2, tp=2, ep=4).problems()  # etp 1: ep takes the tp ranks too
    assert any("must divide tp=2" in p for p in Strategy(dp=2, tp=2, etp=4).problems())
    assert Strategy(dp=8, ep=2, global_batch_size=8).short().startswith("dp8-tp1-pp1-ep2-")
    assert "ep" in dimensions.parallel_axes(Strategy(dp=8, ep=2))
    assert Strategy(dp=8, ep=2).world_size == 8
    torch_lacks = RuntimeOptions.get("torch").lacks  # the Engine runs ep, with any etp | tp
    assert not torch_lacks(dense) and not torch_lacks(Strategy(tp=2, etp=2))
    assert not torch_lacks(Strategy(tp=4, etp=2))
    titan_lacks = RuntimeOptions.get("torchtitan").lacks  # torchtitan: etp 1 or tp only
    assert any("etp=2 below tp=4" in m for m in titan_lacks(Strategy(tp=4, etp=2)))


def test_a_runtime_without_ep_over_tp_keeps_expert_groups_on_data_and_context_ranks():
    """Megatron-Core and torchtitan (etp 1) let ep groups take tensor-parallel ranks; a runtime
    that folds experts over dp x cp only gets a space where ep divides dp x cp, and
    a strategy asking more is refused naming the feature."""
    import dataclasses

    from autosearch.core.runtime import RUNTIMES

    titan = RUNTIMES["torchtitan"]
    narrow = dataclasses.replace(
        titan,
        name="titan-no-ep-over-tp",
        supports=tuple(f for f in titan.supports if f != "ep_over_tp"),
    )
    args = ("mixtral-8x7b", "h100-sxm:2x8")
    wide = SearchSpace(*args, global_batch_size=64, runtime=titan, cp=1)
    kept = SearchSpace(*args, global_batch_size=64, runtime=narrow, cp=1)
    assert any((lay.dp * lay.cp) % lay.ep for lay in wide.layouts())
    assert all((lay.dp * lay.cp) % lay.ep == 0 for lay in kept.layouts())
    assert {lay.ep for lay in kept.layouts()} == {1, 2, 4, 8}
    over = Strategy(dp=2, tp=8, ep=4, global_batch_size=64)
    assert "ep_over_tp" in narrow.unsupported(over) and "ep_over_tp" not in titan.unsupported(over)
    assert "ep=4 over tensor-parallel ranks" in narrow.lacks(over)[0]
