"""ModelSpec, Strategy, HardwareProfile and Cluster: loading, round trips, and every user error."""

import math
import pathlib
import subprocess
import sys

import pytest
import yaml

from autosearch import Cluster, ModelSpec, SpecError, Strategy
from cost_models import HardwareProfile, profile_names


def test_importing_the_packages_does_not_import_torch():
    code = (
        "import sys, autosearch, cost_models, search_spaces\n"
        "from autosearch import ModelSpec, Strategy, estimate\n"
        "estimate('llama3-8b', 'h100-sxm:1x8', 'dp=8')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_catalog_has_the_required_models():
    for name in [
        "gpt3-125m",
        "gpt3-175b",
        "llama2-7b",
        "llama2-13b",
        "llama2-70b",
        "llama3-8b",
        "llama3-70b",
        "llama3.1-8b",
        "llama3.1-70b",
        "llama3.1-405b",
        "tiny-gpt",
        "tiny-llama",
        "sc21-gpt-1.7b",
        "sc21-gpt-1008b",
    ]:
        m = ModelSpec.load(name)
        assert m.name == name
    assert ModelSpec.load("LLAMA3-8B").name == "llama3-8b"
    assert ModelSpec.load("llama3.1-405b").n_params == pytest.approx(
        405.85e9, rel=0.01
    )  # Llama 3 paper: 405B
    assert ModelSpec.load("gpt3-175b").n_params == pytest.approx(175e9, rel=0.01)


def test_model_defaults_and_yaml(tmp_path):
    m = ModelSpec(n_layers=2, hidden_size=64, n_heads=4, vocab_size=100, seq_len=32)
    assert m.n_kv_heads == 4 and m.ffn_hidden_size == 256 and m.ffn_activation == "gelu"
    path = tmp_path / "mine.yaml"
    path.write_text(
        "n_layers: 2\nhidden_size: 64\nn_heads: 4\nn_kv_heads: 2\nffn_activation: swiglu\n"
        "vocab_size: 100\nseq_len: 32\n"
    )
    loaded = ModelSpec.load(path)
    assert loaded.name == "mine" and loaded.n_kv_heads == 2 and not loaded.is_gpt_style


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(n_layers=-2), "n_layers must be >= 1, got -2"),
        (dict(hidden_size=100, n_heads=3), "hidden_size 100 must be a multiple of n_heads 3"),
        (dict(n_kv_heads=3), "n_heads 4 must be a multiple of n_kv_heads 3"),
        (dict(ffn_activation="relu"), "ffn_activation must be one of"),
        (dict(vocab_size=1.5), "vocab_size must be an integer"),
    ],
)
def test_model_errors_name_the_value(fields, message):
    base = dict(n_layers=2, hidden_size=64, n_heads=4, vocab_size=100, seq_len=32)
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        ModelSpec(**{**base, **fields})


def test_unknown_model_and_bad_files(tmp_path):
    with pytest.raises(SpecError, match="unknown model 'llama9-1t'.*Similar names: llama"):
        ModelSpec.load("llama9-1t")
    with pytest.raises(SpecError, match="does not exist"):
        ModelSpec.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_layers: [1, 2\nhidden_size: 3\n")
    with pytest.raises(SpecError, match="not valid YAML at line"):
        ModelSpec.load(bad)
    partial = tmp_path / "partial.yaml"
    partial.write_text("n_layers: 2\nhidden_size: 64\n")
    with pytest.raises(
        SpecError, match="missing required key\\(s\\) n_heads, vocab_size, seq_len"
    ):
        ModelSpec.load(partial)
    typo = tmp_path / "typo.yaml"
    typo.write_text("n_layer: 2\nhidden_size: 64\nn_heads: 4\nvocab_size: 100\nseq_len: 32\n")
    with pytest.raises(SpecError, match="unknown key\\(s\\) 'n_layer'"):
        ModelSpec.load(typo)


def test_strategy_defaults_and_derived():
    s = Strategy()
    assert (s.dp, s.tp, s.pp, s.micro_batch_size, s.global_batch_size) == (1, 1, 1, 1, 1)
    assert (
        s.pipeline_schedule,
        s.virtual_stages,
        s.recompute,
        s.sequence_parallel,
        s.zero_stage,
        s.amp,
    ) == ("1f1b", 1, "none", False, 0, "bf16")
    s = Strategy(dp=4, micro_batch_size=2)
    assert s.global_batch_size == 8 and s.grad_accum_steps == 1
    assert Strategy(dp=4, micro_batch_size=2, global_batch_size=64).grad_accum_steps == 8


def test_strategy_yaml_round_trip_and_mp_alias(tmp_path):
    s = Strategy(
        dp=2,
        tp=4,
        pp=2,
        micro_batch_size=2,
        global_batch_size=64,
        pipeline_schedule="interleaved_1f1b",
        virtual_stages=2,
        recompute="selective",
        sequence_parallel=True,
        zero_stage=1,
        amp="fp16",
    )
    path = tmp_path / "s.yaml"
    s.to_yaml(path)
    assert Strategy.from_yaml(path) == s
    assert Strategy.from_yaml(s.to_yaml()) == s
    assert Strategy.from_yaml("mp: 4\ndp: 2\n") == Strategy(tp=4, dp=2)
    assert Strategy.parse("dp=2,mp=4,sequence_parallel=true,recompute=full") == Strategy(
        dp=2, tp=4, sequence_parallel=True, recompute="full"
    )
    assert Strategy.parse(str(path)) == s


@pytest.mark.parametrize(
    "text,message",
    [
        ("dp=0", "dp must be >= 1, got 0"),
        ("dp=-2", "dp must be >= 1, got -2"),
        ("amp=fp8", "amp must be one of fp32, fp16, bf16"),
        ("zero_stage=4", "zero_stage must be 0, 1, 2 or 3"),
        ("recompute=some", "recompute must be one of none, selective, selective_op, full"),
        ("dp=2,pipelines=3", "unknown key\\(s\\) 'pipelines'"),
        ("dp", "is not key=value"),
        ("tp=2,mp=2", "'tp' is given twice"),
    ],
)
def test_strategy_field_errors(text, message):
    with pytest.raises(SpecError, match=message):
        Strategy.parse(text)


def test_validate_names_every_violated_rule_with_its_fix():
    model = ModelSpec.load("gpt3-13b")  # 40 layers, 40 heads
    cluster = Cluster.parse("a100-sxm4-80gb:2x8")  # 16 devices
    bad = Strategy(
        dp=3,
        tp=3,
        pp=3,
        micro_batch_size=2,
        global_batch_size=10,
        sequence_parallel=False,
        virtual_stages=2,
        pipeline_split=(7, 7, 7, 7, 7),
    )
    with pytest.raises(SpecError) as err:
        bad.validate(model, cluster)
    text = str(err.value)
    assert "dp*tp*pp = 3*3*3 = 27 but the cluster has 16 devices" in text
    assert "tp=3 does not divide n_heads=40" in text
    assert "pipeline_split has 5 chunks but pp*virtual_stages = 6" in text
    assert "global_batch_size=10 does not split into dp*micro_batch_size = 3*2 = 6" in text
    assert "virtual_stages=2 needs pipeline_schedule interleaved_1f1b" in text
    assert text.count("\n  - ") == 5


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(sequence_parallel=True), "sequence_parallel needs tp > 1"),
        (dict(dp=4, pp=4, global_batch_size=8), "needs at least 4 micro-batches per step, got 2"),
        (
            dict(
                dp=4,
                pp=4,
                global_batch_size=24,
                pipeline_schedule="interleaved_1f1b",
                virtual_stages=2,
            ),
            "micro-batch count 6 to be a multiple of pp=4",
        ),
        (
            dict(dp=16, pipeline_schedule="interleaved_1f1b", virtual_stages=2),
            "interleaved_1f1b needs pp > 1",
        ),
        (dict(dp=2, tp=8, global_batch_size=2), None),
    ],
)
def test_validate_single_rules(fields, message):
    model = ModelSpec.load("llama2-7b")
    cluster = Cluster.parse("h100-sxm:2x8")
    s = Strategy(**{"dp": 16, **fields})
    if message is None:
        assert s.validate(model, cluster) is s
    else:
        with pytest.raises(SpecError, match=message):
            s.validate(model, cluster)


def test_kv_heads_rule():
    with pytest.raises(SpecError, match="tp=16 does not divide n_kv_heads=8"):
        Strategy(dp=1, tp=16).validate(ModelSpec.load("llama2-70b"))


def test_profiles_load_and_cite_sources():
    assert {"a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm", "h200-sxm"} <= set(profile_names())
    for name in profile_names():
        p = HardwareProfile.load(name)
        assert p.sources and all(k in p.peak_flops for k in ("fp32", "tf32", "fp16", "bf16"))
        assert p.intra_node.bandwidth_bytes_per_s > p.inter_node.bandwidth_bytes_per_s > 0
        again = HardwareProfile.from_dict(p.to_dict())
        assert again.to_dict() == p.to_dict()


def test_cluster_forms(tmp_path):
    c = Cluster.parse("h100-sxm:32x8")
    assert (c.n_nodes, c.gpus_per_node, c.world_size) == (32, 8, 256)
    with pytest.raises(SpecError, match="ambiguous"):
        Cluster.parse("h100-sxm:4")  # 4 nodes or 4 GPUs? NODESxGPUS says
    assert Cluster.parse("a100-sxm4-40gb").world_size == 8
    f = tmp_path / "c.yaml"
    f.write_text("gpu: h200-sxm\nn_nodes: 2\ngpus_per_node: 4\n")
    assert Cluster.parse(str(f)) == Cluster(gpu="h200-sxm", n_nodes=2, gpus_per_node=4)
    prof = tmp_path / "mine.yaml"
    HardwareProfile.load("h100-sxm").to_yaml(prof)
    assert Cluster.parse(f"{prof}:2x8").profile.peak_flops["bf16"] == 989.4e12
    with pytest.raises(SpecError, match="unknown GPU 'v100'; known profiles: a100-sxm4-40gb"):
        Cluster.parse("v100:2x8")
    with pytest.raises(SpecError, match="n_nodes must be >= 1"):
        Cluster(gpu="h100-sxm", n_nodes=0)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\ngpus_per_node: 8\n")
    with pytest.raises(SpecError, match="missing key\\(s\\) peak_flops"):
        Cluster(gpu=str(broken))


def test_cpu_profiles_follow_the_process_count(tmp_path):
    """A CPU 'device' is a process sharing the cores: a calibration variant for that many processes
    is used when recorded, otherwise the measured processes are time-shared."""
    base = HardwareProfile.load("h100-sxm").to_dict()
    two = {
        **base,
        "name": "cpu-two",
        "device_type": "cpu",
        "gpus_per_node": 2,
        "calibration": {"variants": {1: "one.yaml"}},
    }
    one = {
        **base,
        "name": "cpu-one",
        "device_type": "cpu",
        "gpus_per_node": 1,
        "peak_flops": {k: 2 * v for k, v in base["peak_flops"].items()},
    }
    import yaml

    (tmp_path / "two.yaml").write_text(yaml.safe_dump(two))
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(one))
    path = str(tmp_path / "two.yaml")
    assert Cluster(gpu=path, gpus_per_node=2).profile.name == "cpu-two"
    assert Cluster(gpu=path, gpus_per_node=1).profile.name == "cpu-one"
    four = Cluster(gpu=path, gpus_per_node=4).profile
    assert four.peak_flops["bf16"] == pytest.approx(base["peak_flops"]["bf16"] / 2)
    # a profile rewritten on disk is read again (calibrate, then tune, in one process)
    two["peak_flops"] = {k: 3 * v for k, v in base["peak_flops"].items()}
    import os

    (tmp_path / "two.yaml").write_text(yaml.safe_dump(two))
    os.utime(tmp_path / "two.yaml", (1e9, 2e9))
    assert Cluster(gpu=path).profile.peak_flops["bf16"] == pytest.approx(
        3 * base["peak_flops"]["bf16"]
    )


def test_model_free_rules_and_scaled_defaults():
    assert Strategy(dp=2, global_batch_size=3).problems(None) == [
        "global_batch_size=3 does not split into dp*micro_batch_size = 2*1 = 2; use a global batch"
        " that is a multiple of 2"
    ]
    assert Strategy(tp=3).problems(None) == []  # no model: head rules are not checked
    small = ModelSpec.load("tiny-gpt").scaled(n_heads=2, hidden_size=128)
    assert (small.n_kv_heads, small.ffn_hidden_size) == (2, 512)
    gqa = ModelSpec.load("tiny-llama").scaled(n_layers=2)
    assert (gqa.n_kv_heads, gqa.ffn_hidden_size) == (4, 688)


# ---- hostile or broken input to the floor (issue: nothing silently wrong) -----------------------


def _profile_dict():
    from autosearch.core.hardware import _profiles_dir

    return yaml.safe_load((_profiles_dir() / "h100-sxm.yaml").read_text())


@pytest.mark.parametrize(
    "path,value,words",
    [
        (("kernel_launch_s",), -1.0, "kernel_launch_s = -1 is outside"),
        (("kernel_launch_s",), float("nan"), "finite"),
        (("memory", "capacity_bytes"), float("inf"), "finite"),
        (("memory", "efficiency"), 1.5, "memory.efficiency = 1.5 is outside"),
        (("gemm", "max_efficiency", "bf16"), 0.0, "gemm.max_efficiency.bf16 = 0 is outside"),
        (("attention", "flash_efficiency", "bf16"), "fast", "must be a number"),
        (("intra_node", "latency_s"), -3e-6, "intra_node.latency_s"),
        (("peak_flops", "bf16"), "nan", "finite"),
    ],
)
def test_profile_numbers_are_checked(path, value, words):
    data = _profile_dict()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(SpecError, match=words.replace("(", r"\(")):
        HardwareProfile.from_dict(data, what="test profile")


def test_calibration_profile_cut_short_is_refused(tmp_path):
    text = (
        pathlib.Path(__file__).parents[1] / "results" / "calibration" / "example-amd-epyc-2c.yaml"
    ).read_text()
    cut = text[: text.index("\nkernel_launch_s:")]  # the case: cut before this key
    (tmp_path / "cut.yaml").write_text(cut)
    with pytest.raises(SpecError, match="truncated"):
        HardwareProfile.load(str(tmp_path / "cut.yaml"))


def test_strategy_files_empty_or_truncated_are_refused(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(SpecError, match="is empty"):
        Strategy.from_yaml(empty)
    with pytest.raises(SpecError, match="the strategy is empty"):
        Strategy.parse("")
    whole = Strategy(dp=8, tp=4, global_batch_size=512).to_yaml()
    cut = tmp_path / "cut.yaml"
    cut.write_text(whole[: whole.index("pp:")])
    with pytest.raises(SpecError, match="truncated"):
        Strategy.from_yaml(cut)
    # a hand-written file names only what differs: that stays valid
    short = tmp_path / "short.yaml"
    short.write_text("dp: 8\ntp: 4\npp: 1\n")
    assert Strategy.from_yaml(short) == Strategy(dp=8, tp=4)
    short.write_text("dp: 8\ntp: 4\n")  # a file must name its degrees
    with pytest.raises(SpecError, match="does not name pp"):
        Strategy.from_yaml(short)


def test_estimate_takes_a_dict_and_names_a_wrong_type():
    from autosearch import estimate

    report = estimate("llama3-8b", "h100-sxm:8x8", {"dp": 64, "zero_stage": 3})
    assert math.isfinite(report.step_time_s) and report.step_time_s > 0
    with pytest.raises(TypeError, match="got int"):
        estimate("llama3-8b", "h100-sxm:8x8", 64)


def test_uneven_pipeline_splits():
    """126 layers over 8 stages: the middle stages take the extra layers (as torchtitan and
    Megatron-LM split Llama 3.1 405B); an explicit split must cover every layer."""
    model = ModelSpec.load("llama3.1-405b")
    s = Strategy(dp=8, tp=8, pp=8, global_batch_size=64)
    assert s.problems(model) == []
    assert s.layers_per_chunk(model.n_layers) == (15, 16, 16, 16, 16, 16, 16, 15)
    wrong = s.replace(pipeline_split=(16,) * 8)
    assert any("sums to 128 layers, not n_layers=126" in p for p in wrong.problems(model))
    assert Strategy.parse("pp=2,pipeline_split=10/22").pipeline_split == (10, 22)


def test_pipeline_chunks_may_be_empty_but_not_a_whole_rank():
    """A chunk may hold no layer (Megatron-Core's layouts: the embedding, the loss or the MTP
    modules alone, 'E|t*16|t*16|L'); a pipeline rank with no layer in any of its chunks is
    refused, with the rank and its chunks; recompute_num_layers is bounded by the smallest
    chunk that has layers."""
    model = ModelSpec.load("llama3-8b")
    interleaved = dict(pp=2, virtual_stages=2, pipeline_schedule="interleaved_1f1b")
    ends = Strategy(dp=4, **interleaved, global_batch_size=64, pipeline_split=(0, 16, 16, 0))
    assert ends.problems(model) == []
    idle = ends.replace(pipeline_split=(16, 0, 16, 0))
    assert any(
        "gives pipeline rank 1 no layer (its chunks are [1, 3]" in p for p in idle.problems(model)
    )
    alone = Strategy.parse("pp=2,global_batch_size=8,pipeline_split=0/32").problems(model)
    assert any("gives pipeline rank 0 no layer" in p for p in alone)  # no vp: a rank, empty
    with pytest.raises(SpecError, match="pipeline_split entry must be >= 0, got -1"):
        Strategy(pp=2, pipeline_split=(-1, 33))
    block = ends.replace(recompute="full", recompute_num_layers=16)
    assert block.problems(model) == []


def test_new_dimensions_have_rules():
    model = ModelSpec.load("llama3-8b")
    h100, a100 = Cluster.parse("h100-sxm:1x8"), Cluster.parse("a100-sxm4-80gb:1x8")
    assert Strategy(dp=4, cp=2, global_batch_size=8).problems(model, h100) == []
    assert Strategy(dp=4, cp=2).world_size == 8
    problems = Strategy(dp=8, fp8="tensorwise", async_tp=True).problems(model, a100)
    assert any("fp8=tensorwise needs float8" in p for p in problems)
    assert any("async_tp" in p and "tp > 1" in p for p in problems)
    bad = Strategy(dp=8, recompute="selective", recompute_num_layers=2).problems(model)
    assert any("needs recompute=full" in p for p in bad)
    odd = model.scaled(seq_len=1000)
    assert any("divisible by 2*cp = 16" in p for p in Strategy(cp=8).problems(odd))


def test_an_integer_read_as_a_float_stays_an_integer():
    """Issue 35: ``zero_stage: 1.0`` is stage 1, an int (it printed as ``z1.0`` before), as a
    degree of 8.0 is 8."""
    s = Strategy.from_dict({"dp": 8.0, "zero_stage": 1.0, "global_batch_size": 64})
    assert type(s.zero_stage) is int and type(s.dp) is int
    assert "-z1-" in s.short() and "z1.0" not in s.short()
