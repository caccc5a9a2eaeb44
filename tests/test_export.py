"""Exporters: one contract suite that every exporter passes, then a few runtime specifics."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, installed by the test extra
    import tomli as tomllib  # type: ignore[no-redef]

from autosearch import Cluster, ModelSpec, SpecError, Strategy
from autosearch.export import EXPORTERS, export
from autosearch.export._base import strategy_fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ModelSpec.load("llama3-70b")
STRATEGIES = [
    Strategy(dp=64, global_batch_size=512),
    Strategy(dp=64, global_batch_size=512, zero_stage=3, recompute="full", amp="bf16"),
    Strategy(
        dp=8,
        tp=8,
        pp=4,
        micro_batch_size=2,
        global_batch_size=512,
        recompute="selective",
        sequence_parallel=True,
        zero_stage=1,
    ),
    Strategy(
        dp=4,
        tp=8,
        pp=8,
        micro_batch_size=1,
        global_batch_size=512,
        pipeline_schedule="interleaved_1f1b",
        virtual_stages=5,
        amp="fp16",
        zero_stage=2,
    ),
    Strategy(
        dp=16,
        tp=4,
        pp=4,
        micro_batch_size=1,
        global_batch_size=256,
        pipeline_schedule="gpipe",
        amp="fp32",
    ),
    # the dimensions added since: context parallel, an uneven split, part of the layers
    # recomputed, fp8, torch.compile, async tensor parallel
    Strategy(
        dp=4,
        tp=8,
        pp=4,
        cp=2,
        global_batch_size=512,
        pipeline_split=(19, 21, 21, 19),
        recompute="full",
        recompute_num_layers=2,
        sequence_parallel=True,
        zero_stage=1,
        fp8="rowwise",
        compile=True,
        async_tp=True,
    ),
    Strategy(
        dp=8,
        tp=4,
        pp=4,
        cp=2,
        global_batch_size=512,
        recompute="selective_op",
        sequence_parallel=True,
        zero_stage=3,
        fp8="tensorwise",
        compile=True,
    ),
]


@pytest.fixture(params=sorted(EXPORTERS))
def exporter(request):
    return EXPORTERS[request.param]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.short())
@pytest.mark.parametrize("with_model", [False, True])
def test_contract_every_field_is_mapped_or_declared_unsupported(exporter, strategy, with_model):
    out = exporter.export(strategy, model=MODEL if with_model else None)
    assert out.runtime == exporter.name and out.text.strip()
    unsupported = {field for field, _ in out.unsupported}
    assert out.mapped | unsupported == set(strategy_fields())
    assert not out.mapped & unsupported
    assert all(why.strip() for _, why in out.unsupported)
    rendered = out.render()
    assert rendered.startswith(out.text.rstrip())
    assert ("no equivalent" in rendered) == bool(out.unsupported)
    for number in (strategy.tp, strategy.pp, strategy.global_batch_size):
        assert str(number) in rendered


def test_contract_text_is_machine_readable(exporter):
    for strategy in STRATEGIES:
        text = exporter.export(strategy, model=MODEL).text
        if exporter.name == "deepspeed":
            assert json.loads(text)["train_batch_size"] == strategy.global_batch_size
        elif exporter.name == "torchtitan":
            cfg = tomllib.loads(text)
            assert cfg["parallelism"]["tensor_parallel_degree"] == strategy.tp
        else:
            assert f"--micro-batch-size {strategy.micro_batch_size}" in text


def test_runtime_specifics():
    interleaved = STRATEGIES[3]
    mega = export(interleaved, to="megatron", model=MODEL)
    assert "--num-layers-per-virtual-pipeline-stage 2" in mega.text and "--fp16" in mega.text
    gpipe = export(STRATEGIES[4], to="megatron")
    assert dict(gpipe.unsupported)["pipeline_schedule"].startswith("Megatron-LM has no GPipe")
    ds = export(interleaved, to="deepspeed")
    assert {"virtual_stages", "zero_stage"} <= dict(ds.unsupported).keys()
    tt = export(STRATEGIES[2], to="torchtitan")
    assert "zero_stage" in dict(tt.unsupported)  # FSDP2 has no ZeRO-1
    with pytest.raises(SpecError, match="unknown runtime 'jax'.*megatron"):
        export(STRATEGIES[0], to="jax")


def test_cli_export_prints_config_on_stdout_and_caveats_on_stderr(tmp_path):
    path = tmp_path / "best.yaml"
    STRATEGIES[3].to_yaml(path)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "autosearch",
            "export",
            "--strategy",
            str(path),
            "--to",
            "deepspeed",
            "--model",
            "llama3-70b",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["zero_optimization"]["stage"] == 2
    assert "no equivalent in deepspeed" in run.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "autosearch",
            "export",
            "--strategy",
            str(path),
            "--to",
            "megatron",
            "--model",
            "gpt3-125m",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert (
        bad.returncode == 2
        and "does not divide n_heads" in bad.stderr
        and "Traceback" not in bad.stderr
    )


# ---- exports that run: each parsed as its runtime parses it, and read back ----------------------
MODELS = [
    ModelSpec.load("llama3-70b"),  # GQA, SwiGLU, untied
    ModelSpec.load("gpt3-13b"),  # GPT style: LayerNorm, learned positions, biases
    ModelSpec(
        name="tied-llama",
        n_layers=40,
        hidden_size=2048,
        n_heads=16,
        ffn_hidden_size=5632,
        ffn_activation="swiglu",
        vocab_size=32000,
        seq_len=2048,
        tied_embeddings=True,
    ),
]
CLUSTER = Cluster.parse("h100-sxm:32x8")


def megatron_parser() -> argparse.ArgumentParser:
    """An argparse parser with exactly the flag names the exporter documents (FLAGS, each cited
    to Megatron-Core / Megatron-Bridge / Megatron-LM), typed as Megatron-LM types them."""
    from autosearch.export._megatron import FLAGS

    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    parser.add_argument("script")
    kinds = {"int": int, "float": float, "str": str}
    for flag, (kind, _) in FLAGS.items():
        if kind == "switch":
            parser.add_argument(flag, action="store_true")
        elif kind == "list":  # nargs="+", as Megatron-LM's --recompute-modules
            parser.add_argument(flag, nargs="+")
        else:
            parser.add_argument(flag, type=kinds[kind])
    return parser


def megatron_layout(text: str) -> list[str]:
    """The stages of a --pipeline-model-parallel-layout, as Megatron-Core parses it
    (transformer/pipeline_parallel_layer_layout.py `parse_str_to_list`: commas dropped,
    "(...)*n" then "x*n" unrolled, stages split by "|"); checks what `validate_layer_layout`
    asserts of the embedding, the loss and the MTP modules."""
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), text)
    assert set(text) <= set("ELtm|"), text
    flat = text.replace("|", "")
    assert flat[0] == "E" and flat[-1] == "L" and flat.count("E") == flat.count("L") == 1
    assert "t" not in flat[flat.find("m") :] if "m" in flat else True  # MTP after the decoder
    return text.split("|")


def megatron_round_trip(text: str, world_size: int):
    """The ModelSpec and Strategy that Megatron-LM would run with these arguments."""
    argv = shlex.split(text.replace("\\\n", " "))
    if argv[0] == "torchrun":
        argv = argv[5:]  # torchrun --nnodes N --nproc-per-node G
    a = megatron_parser().parse_args(argv)
    model = ModelSpec(
        name="read-back",
        n_layers=a.num_layers,
        hidden_size=a.hidden_size,
        n_heads=a.num_attention_heads,
        n_kv_heads=a.num_query_groups if a.group_query_attention else a.num_attention_heads,
        head_dim=a.kv_channels,
        ffn_hidden_size=a.ffn_hidden_size,
        ffn_activation="swiglu" if a.swiglu else "gelu",
        vocab_size=a.vocab_size + 1,  # NullTokenizer appends an end-of-document token
        seq_len=a.seq_length,
        tied_embeddings=not a.untie_embeddings_and_output_weights,
        position_embedding={"rope": "rotary", "learned_absolute": "learned"}[
            a.position_embedding_type
        ],
        linear_bias=not a.disable_bias_linear,
        dropout=not (a.hidden_dropout == 0.0 and a.attention_dropout == 0.0),
    )
    assert a.max_position_embeddings == a.seq_length
    assert a.normalization == ("RMSNorm" if a.swiglu else "LayerNorm")
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    cp = a.context_parallel_size or 1
    v = 1
    if a.num_layers_per_virtual_pipeline_stage:
        v = a.num_layers // (pp * a.num_layers_per_virtual_pipeline_stage)
    split = None
    if a.pipeline_model_parallel_layout:
        stages = megatron_layout(a.pipeline_model_parallel_layout)
        v = len(stages) // pp
        split = tuple(stage.count("t") for stage in stages)
    first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
    if first or last:  # Megatron: the given first/last stages, the other layers evenly
        middle = pp - (first is not None) - (last is not None)
        even = (a.num_layers - (first or 0) - (last or 0)) // middle if middle else 0
        split = (first or even,) + (even,) * (pp - 2) + (last or even,)
    recompute = a.recompute_granularity or "none"
    recompute_num_layers = None
    if recompute == "full" and a.recompute_method == "block":
        recompute_num_layers = a.recompute_num_layers
    elif recompute == "full":
        assert (a.recompute_method, a.recompute_num_layers) == ("uniform", 1)
    strategy = Strategy(
        dp=world_size // (tp * pp * cp),
        tp=tp,
        pp=pp,
        cp=cp,
        micro_batch_size=a.micro_batch_size,
        global_batch_size=a.global_batch_size,
        pipeline_schedule="interleaved_1f1b" if v > 1 else "1f1b",
        virtual_stages=v,
        recompute=recompute,
        sequence_parallel=a.sequence_parallel,
        zero_stage=3 if a.use_torch_fsdp2 else (1 if a.use_distributed_optimizer else 0),
        amp="bf16" if a.bf16 else ("fp16" if a.fp16 else "fp32"),
        pipeline_split=split,
        recompute_num_layers=recompute_num_layers,
        fp8=a.fp8_recipe or "none",
        async_tp=a.tp_comm_overlap,
    )
    return model, strategy


def megatron_script_args(text: str) -> str:
    """The pretrain_gpt.py arguments of a megatron.sh, between the program and the data."""
    body = text.split('"$MEGATRON_LM/pretrain_gpt.py"', 1)[1].split('"${DATA[@]}"', 1)[0]
    return "pretrain_gpt.py" + body.rstrip().rstrip("\\")


def same_except(a: Strategy, b: Strategy, fields: set[str], model=None) -> bool:
    """Equal but for `fields`; an explicit split equal to the default one counts as the same."""
    if model is not None:
        a = a.replace(pipeline_split=a.layers_per_chunk(model.n_layers))
        b = b.replace(pipeline_split=b.layers_per_chunk(model.n_layers))
    da, db = a.to_dict(), b.to_dict()
    return {k: v for k, v in da.items() if k not in fields} == {
        k: v for k, v in db.items() if k not in fields
    }


def layouts_for(model: ModelSpec) -> list[Strategy]:
    """Strategies of STRATEGIES' kinds that are valid for `model` on CLUSTER."""
    out = []
    for s in STRATEGIES:
        if s.world_size != CLUSTER.world_size:
            continue
        if s.virtual_stages > 1:
            v = next(v for v in (5, 4, 2) if model.n_layers % (s.pp * v) == 0)
            s = s.replace(virtual_stages=v)
        if not s.problems(model, CLUSTER):
            out.append(s)
    return out


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_megatron_arguments_parse_and_round_trip(model):
    strategies = layouts_for(model)
    assert len(strategies) >= 3
    for s in strategies:
        out = export(s, to="megatron", model=model, cluster=CLUSTER)
        assert out.text.startswith("torchrun --nnodes 32 --nproc-per-node 8 pretrain_gpt.py")
        back_model, back = megatron_round_trip(out.text, CLUSTER.world_size)
        assert back_model.to_dict() == {**model.to_dict(), "name": "read-back"}
        lossy = {f for f, _ in out.unsupported}
        assert same_except(back, s, lossy, model), (back.short(), s.short())
        if s.pp > 1 and s.pipeline_schedule == "gpipe":
            assert back.pipeline_schedule == "1f1b" and "pipeline_schedule" in lossy


def test_deepspeed_config_keys_are_deepspeeds_and_round_trip():
    from autosearch.export._deepspeed import KEYS, LAUNCH_FLAGS

    def paths(d, prefix=""):
        for k, v in d.items():
            yield prefix + k
            if isinstance(v, dict):
                yield from paths(v, prefix + k + ".")

    launcher = argparse.ArgumentParser(prog="deepspeed", allow_abbrev=False)
    for flag in LAUNCH_FLAGS:
        if flag == "--deepspeed":
            launcher.add_argument(flag, action="store_true")
        else:
            launcher.add_argument(flag)
    launcher.add_argument("script")
    for s in STRATEGIES:
        cluster = Cluster(gpu="h100-sxm", n_nodes=s.world_size // 8)
        out = export(s, to="deepspeed", model=MODEL, cluster=cluster)
        cfg = json.loads(out.text)
        assert set(paths(cfg)) <= set(KEYS), set(paths(cfg)) - set(KEYS)
        gas = cfg["gradient_accumulation_steps"]
        mbs = cfg["train_micro_batch_size_per_gpu"]
        # DeepSpeed's own check (runtime/config.py _batch_assertion):
        # train_batch_size == micro_batch * gradient_accumulation * data-parallel world size
        assert cfg["train_batch_size"] == mbs * gas * s.dp
        amp = "bf16" if "bf16" in cfg else ("fp16" if "fp16" in cfg else "fp32")
        back = {
            "dp": cfg["train_batch_size"] // (mbs * gas),
            "tp": cfg.get("tensor_parallel", {}).get("autotp_size", 1),
            "pp": cfg.get("pipeline", {}).get("stages", 1),
            "micro_batch_size": mbs,
            "global_batch_size": cfg["train_batch_size"],
            "zero_stage": cfg["zero_optimization"]["stage"],
            "amp": amp,
        }
        assert back == {k: getattr(s, k) for k in back}
        argv = shlex.split(out.command)
        assert argv[0] == "deepspeed"
        a = launcher.parse_args(argv[1:])
        assert int(a.num_nodes) * int(a.num_gpus) == s.world_size
        assert a.deepspeed and a.deepspeed_config == "ds_config.json"


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_torchtitan_toml_keys_are_torchtitans_and_round_trip(model):
    from autosearch.export._torchtitan import KEYS
    from autosearch.export._torchtitan_models import FLAVORS

    def sections(cfg, prefix=""):
        """[a.b.c] tables by dotted name (tomllib nests them)."""
        for name, value in cfg.items():
            if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
                yield from sections(value, prefix + name + ".")
            else:
                yield prefix + name, value

    schedules = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved_1f1b"}
    for s in layouts_for(model):
        out = export(s, to="torchtitan", model=model, cluster=CLUSTER, allow_unsupported=True)
        assert bool(out.refused) == model.is_gpt_style  # GPT style: refused unless allowed
        cfg = dict(sections(tomllib.loads(out.text)))
        for section, values in cfg.items():
            assert set(values) <= set(KEYS[section]), (section, set(values) - set(KEYS[section]))
        par, tr, ac = cfg["parallelism"], cfg["training"], cfg["activation_checkpoint"]
        dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
        pp = par["pipeline_parallel_degree"]
        # torchtitan/train.py: accumulation = global / (local * dp); with a pipeline, local is
        # split into micro-batches of pipeline_parallel_microbatch_size.
        mbs = par.get("pipeline_parallel_microbatch_size", tr["local_batch_size"])
        v, split = 1, None
        if "pipeline_parallel_layers_per_stage" in par:
            v = model.n_layers // (pp * par["pipeline_parallel_layers_per_stage"])
        if "module_fqns_per_model_part" in par:
            parts = par["module_fqns_per_model_part"]
            split = tuple(sum(x.startswith("layers.") for x in part) for part in parts)
            v = len(parts) // pp
            assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
        zero = {"never": 2, "always": 3}.get(par.get("fsdp_reshard_after_forward"), 0)
        selective = ac.get("selective_ac_option") == "op"
        fp8 = cfg.get("quantize.linear.float8", {}).get("recipe_name", "none")
        if fp8 != "none" and "model" in cfg:
            assert "quantize.linear.float8" in cfg["model"]["converters"]
        back = Strategy(
            dp=dp,
            tp=par["tensor_parallel_degree"],
            pp=pp,
            cp=par.get("context_parallel_degree", 1),
            micro_batch_size=mbs,
            global_batch_size=tr["global_batch_size"],
            pipeline_schedule=schedules[par.get("pipeline_parallel_schedule", "1F1B")],
            virtual_stages=v,
            pipeline_split=split,
            recompute="selective_op" if selective else ac["mode"],
            sequence_parallel=s.sequence_parallel,  # torchtitan 0.2: on whenever tp > 1
            zero_stage=zero,
            amp={"bfloat16": "bf16", "float32": "fp32"}[tr["mixed_precision_param"]],
            fp8=fp8,
            compile=cfg.get("compile", {}).get("enable", False),
            async_tp=par.get("enable_async_tensor_parallel", False),
        )
        assert dp * back.tp * pp * back.cp == CLUSTER.world_size
        assert tr["global_batch_size"] % (tr["local_batch_size"] * dp) == 0
        assert tr["seq_len"] == model.seq_len
        lossy = {f for f, _ in out.unsupported}
        assert same_except(back, s, lossy, model), (back.short(), s.short())
        name, flavor = cfg["model"]["name"], cfg["model"]["flavor"]
        if (name, flavor) in FLAVORS:  # a shipped flavor: no module of its own
            assert not out.files and "experimental" not in cfg
        else:  # a flavor of its own, registered by the module the job imports
            assert cfg["experimental"]["custom_import"] == "torchtitan_flavor"
            module = dict(out.files)["torchtitan_flavor.py"]
            assert f"{name}_args['autosearch'] = " in module and flavor == "autosearch"
            compile(module, "torchtitan_flavor.py", "exec")


def test_cli_export_writes_runnable_files_next_to_a_study(tmp_path):
    """`autosearch export --to all --out DIR` from a tuner's best_strategy.yaml: the model and
    cluster come from the study; every file parses."""
    from autosearch.cli import main

    study = tmp_path / "study"
    argv = ["tune", "--model", "llama3-70b", "--cluster", "h100-sxm:32x8"]
    argv += ["--global-batch-size", "512", "--n-trials", "10", "--quiet", "--out", str(study)]
    assert main(argv) == 0
    best = Strategy.from_yaml(str(study / "best_strategy.yaml"))
    # tune wrote them next to best_strategy.yaml already
    for name in ("megatron.sh", "ds_config.json", "deepspeed_launch.sh", "torchtitan.toml"):
        assert (study / name).is_file()
    assert json.loads((study / "ds_config.json").read_text())["train_batch_size"] == 512
    out = tmp_path / "exports"
    # --force: the Engine's pick may not run, or fit, under another framework (the files then
    # say so on top; tests/test_export_fields.py checks the refusal)
    export = ["export", "--strategy", str(study / "best_strategy.yaml"), "--to", "all"]
    assert main(export + ["--out", str(out), "--force"]) == 0
    assert sorted(os.listdir(out)) == [
        ".autosearch",  # the marker of a folder autosearch made (it writes only into its own)
        "deepspeed_launch.sh",
        "ds_config.json",
        "megatron.sh",
        "torchtitan.sh",
        "torchtitan.toml",
        "torchtitan_flavor.py",  # Llama 3 without 3.1's RoPE scaling: a flavor of its own
    ]
    model, strategy = megatron_round_trip(
        megatron_script_args((out / "megatron.sh").read_text()), 256
    )
    assert model.n_layers == 80 and model.n_kv_heads == 8
    assert strategy.tp == best.tp and strategy.global_batch_size == 512
    assert json.loads((out / "ds_config.json").read_text())["train_batch_size"] == 512
    cfg = tomllib.loads((out / "torchtitan.toml").read_text())
    assert cfg["model"] == {"name": "qwen3", "flavor": "autosearch"}
    launch = (out / "deepspeed_launch.sh").read_text()
    assert "NNODES=32\nGPUS_PER_NODE=8\n" in launch and "--rdzv-backend c10d" in launch
    assert "#   deepspeed --num_nodes 32 --num_gpus 8 --hostfile hostfile" in launch
    assert os.access(out / "megatron.sh", os.X_OK)


# ---- the documented names against the real packages -------------------------------------------
def _package_dir(name: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(name)  # top level only: nothing is imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def _dataclass_fields(path: str) -> dict[str, set[str]]:
    """Annotated field names of every class in a source file (read with ast, not imported)."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    return out


@pytest.mark.skipif(_package_dir("megatron") is None, reason="megatron-core is not installed")
def test_megatron_flags_are_megatron_core_fields():
    """Run where megatron-core is installed (pip install --no-deps megatron-core): every flag
    cited to a Megatron-Core config class names a field of that class."""
    from autosearch.export._megatron import FLAGS

    root = os.path.join(_package_dir("megatron"), "core")
    classes = {}
    for rel in (
        "transformer/transformer_config.py",
        "model_parallel_config.py",
        "distributed/distributed_data_parallel_config.py",
    ):
        classes.update(_dataclass_fields(os.path.join(root, rel)))
    checked = 0
    for flag, (_, source) in FLAGS.items():
        cls, _, field = source.split()[0].partition(".")
        if cls in classes:
            field = field.rstrip(".") if not field.endswith("...") else field[:-3]
            assert any(f.startswith(field) for f in classes[cls]), (flag, source)
            checked += 1
    assert checked >= 15


@pytest.mark.skipif(_package_dir("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_keys_are_in_deepspeed():
    """Run where DeepSpeed is installed (DS_BUILD_OPS=0 pip install --no-deps deepspeed): every
    key's constant or field is defined in the file its citation names, with that spelling."""
    import re

    from autosearch.export._deepspeed import KEYS

    root = _package_dir("deepspeed")
    for key, source in KEYS.items():
        words = source.split()
        rel = words[0] if words[0].startswith("deepspeed/") else "deepspeed/runtime/" + words[0]
        with open(os.path.join(root, rel[len("deepspeed/") :]), encoding="utf-8") as f:
            text = f.read()
        last = key.rsplit(".", 1)[-1]
        if len(words) > 1 and words[1].isupper():
            assert re.search(rf"^{words[1]} = ['\"]{last}['\"]", text, re.M), (key, source)
        else:
            assert re.search(rf"['\"]?{last}['\"]?\s*[:=]", text), (key, source)


@pytest.mark.skipif(_package_dir("torchtitan") is None, reason="torchtitan is not installed")
def test_torchtitan_keys_are_job_config_fields():
    """Run where torchtitan 0.2.x is installed (pip install --no-deps torchtitan==0.2.2): every
    section is a field of JobConfig and every key a field of that section's class."""
    path = os.path.join(_package_dir("torchtitan"), "config", "job_config.py")
    if not os.path.exists(path):
        pytest.skip("torchtitan >= 0.3 has no TOML job config (job_config.py)")
    from autosearch.export._torchtitan import KEYS, SECTION_CLASSES

    classes = _dataclass_fields(path)
    assert {k.split(".")[0] for k in KEYS} <= classes["JobConfig"]
    for section, keys in KEYS.items():
        assert set(keys) <= classes[SECTION_CLASSES[section]], (section, keys)


# ---- mixture of experts: the model flags Megatron-LM needs, read back into the same model -------
MOE_MODELS = ["deepseek-v3", "qwen3-30b-a3b", "llama4-maverick", "mixtral-8x7b"]


def _moe_read_back(a, model: ModelSpec) -> ModelSpec:
    """`model` with its MoE and MLA blocks as Megatron-LM would build them from `a`."""
    import dataclasses

    from autosearch.core._moe import MLASpec, MoESpec

    # which layers hold experts: Megatron's 0/1 list (every layer without the flag), checked
    # against ModelSpec.moe_layers, which first_dense_layers and layer_step define
    layers = eval(a.moe_layer_freq) if a.moe_layer_freq else [1] * a.num_layers
    assert tuple(map(bool, layers)) == model.moe_layers
    dense, step = model.moe.first_dense_layers, model.moe.layer_step
    balancing = {"aux_loss": "aux_loss", "seq_aux_loss": "aux_loss_free", "none": "none"}
    assert a.moe_router_enable_expert_bias == (a.moe_router_load_balancing_type == "seq_aux_loss")
    assert a.moe_grouped_gemm and a.moe_token_dispatcher_type == "alltoall"
    n_shared = model.moe.n_shared_experts
    moe = MoESpec(
        n_experts=a.num_experts,
        top_k=a.moe_router_topk,
        ffn_hidden_size=a.moe_ffn_hidden_size,
        n_shared_experts=n_shared,
        shared_ffn_hidden_size=(
            a.moe_shared_expert_intermediate_size // n_shared
            if n_shared
            else model.moe.shared_ffn_hidden_size
        ),
        first_dense_layers=dense,
        layer_step=step,
        router=a.moe_router_score_function,
        load_balancing=balancing[a.moe_router_load_balancing_type],
        capacity_factor=a.moe_expert_capacity_factor,
    )
    mla = None
    if a.multi_latent_attention:
        mla = MLASpec(
            q_lora_rank=a.q_lora_rank,
            kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_head_dim,
            qk_rope_head_dim=a.qk_pos_emb_head_dim,
            v_head_dim=a.v_head_dim,
        )
    return dataclasses.replace(model, moe=moe, mla=mla)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_megatron_moe_flags_parse_and_give_back_the_model(name):
    model = ModelSpec.load(name)
    cluster = Cluster.parse("h100-sxm:16x8")
    ep = 8 if model.moe.n_experts % 8 == 0 else 1
    s = Strategy(dp=128, ep=ep, global_batch_size=1024, zero_stage=1)
    out = export(s, to="megatron", model=model, cluster=cluster, allow_unsupported=True)
    # Llama 4's chunked attention has no Megatron-LM setting; the rest is exported
    assert {f for f, _ in out.refused} == ({"arch.attention_chunk"} if "llama4" in name else set())
    a = megatron_parser().parse_args(shlex.split(out.text.replace("\\\n", " "))[5:])
    back = _moe_read_back(a, model)
    assert back.moe == model.moe and back.mla == model.mla
    assert a.expert_model_parallel_size == (ep if ep > 1 else None)
    assert not out.unsupported
    assert any("--moe-aux-loss-coeff" in n for n in out.notes)


def test_megatron_layer_pattern_is_megatrons_list_form():
    from autosearch.export._megatron import _layer_pattern

    assert _layer_pattern((False,) * 3 + (True,) * 58) == "([0]*3+[1]*58)"
    assert _layer_pattern((False, True) * 24) == "([0,1]*24)"
    assert eval(_layer_pattern((False, True) * 24)) == [0, 1] * 24


@pytest.mark.parametrize(
    ("recompute", "modules", "words"),
    [
        ("none", "layernorm+moe_act", ["selective", "layernorm", "moe_act"]),
        ("selective", "layernorm+moe", ["selective", "core_attn", "layernorm", "moe"]),
        ("none", "none", None),
    ],
)
def test_megatron_recompute_modules(recompute, modules, words):
    model = ModelSpec.load("qwen3-30b-a3b")
    s = Strategy(dp=8, ep=8, recompute=recompute, recompute_modules=modules)
    out = export(s, to="megatron", model=model)
    a = megatron_parser().parse_args(shlex.split(out.text.replace("\\\n", " ")))
    if words is None:
        assert a.recompute_granularity is None and a.recompute_modules is None
    else:
        assert [a.recompute_granularity] + a.recompute_modules == words
    assert "recompute_modules" in out.mapped


def test_recompute_modules_under_full_recompute_is_declared_lost():
    model = ModelSpec.load("qwen3-30b-a3b")
    s = Strategy(dp=8, ep=8, recompute="full", recompute_modules="layernorm+moe")
    out = export(s, to="megatron", model=model)
    assert "--recompute-modules" not in out.text
    assert dict(out.unsupported)["recompute_modules"].startswith("Megatron takes")


def test_torchtitan_writes_expert_degrees_and_refuses_other_etp():
    model = ModelSpec.load("qwen3-30b-a3b")
    out = export(Strategy(dp=4, tp=2, ep=8, etp=2), to="torchtitan", model=model)
    par = tomllib.loads(out.text)["parallelism"]
    assert (par["expert_parallel_degree"], par["expert_tensor_parallel_degree"]) == (8, 2)
    out = export(Strategy(dp=2, tp=4, ep=4, etp=2), to="torchtitan", model=model)
    assert "etp" in dict(out.unsupported) and "etp" not in out.mapped
    out = export(Strategy(dp=8, ep=8, recompute_modules="layernorm+moe_act"), to="torchtitan")
    assert "Megatron's modules" in dict(out.unsupported)["recompute_modules"]


def test_deepspeed_says_what_it_has_no_equivalent_for():
    s = Strategy(dp=8, tp=2, ep=8, etp=2, recompute_modules="layernorm+moe_act")
    out = export(s, to="deepspeed", model=ModelSpec.load("qwen3-30b-a3b"))
    lost = dict(out.unsupported)
    assert {"ep", "etp", "recompute_modules"} <= set(lost)
    assert "deepspeed.moe.layer.MoE" in lost["ep"]


@pytest.mark.parametrize(
    ("name", "pp", "v", "split"),
    [
        ("llama3-8b", 2, 2, (0, 16, 16, 0)),  # "E|t*16|t*16|L": empty ends
        ("llama3-8b", 4, 2, (3, 4, 5, 4, 4, 4, 4, 4)),  # uneven with virtual stages
        ("deepseek-v3", 8, 2, (4,) * 15 + (1,)),  # Megatron-Bridge's, with its MTP module
        ("deepseek-v3", 16, 2, (1,) + (2,) * 30 + (0,)),  # 25.09's 'Et|(tt|)*30mL'
    ],
)
def test_megatron_pipeline_layout_carries_any_split(name, pp, v, split):
    """A split the older flags cannot give (virtual stages, empty chunks, more than the first
    and last chunk differing) goes out as Megatron-Core's --pipeline-model-parallel-layout,
    with the MTP modules before the loss, and reads back as the same split."""
    model = ModelSpec.load(name)
    world = pp * 8
    s = Strategy(
        dp=world // pp,
        pp=pp,
        global_batch_size=world * 2,
        pipeline_schedule="interleaved_1f1b" if v > 1 else "1f1b",
        virtual_stages=v,
        pipeline_split=split,
        ep=8 if model.moe else 1,
    )
    cluster = Cluster(gpu="h100-sxm", n_nodes=world // 8)
    out = export(s, to="megatron", model=model, cluster=cluster)
    assert "pipeline_split" not in {f for f, _ in out.unsupported}
    argv = shlex.split(out.text.replace("\\\n", " "))[5:]
    a = megatron_parser().parse_args(argv)
    assert a.num_layers_per_virtual_pipeline_stage is None  # Megatron refuses both at once
    assert a.decoder_first_pipeline_num_layers is None
    stages = megatron_layout(a.pipeline_model_parallel_layout)
    assert tuple(stage.count("t") for stage in stages) == split and len(stages) == pp * v
    assert stages[-1].count("m") == model.mtp_layers
    if not model.moe:
        assert megatron_round_trip(out.text, world)[1].pipeline_split == split


def test_a_full_disk_during_export_ends_in_one_message_and_leaves_no_half_set(
    tmp_path, monkeypatch
):
    """Issue 35: the disk fills at the third file: one SpecError naming the file and the disk,
    and none of the files this export added (nor the folder it made) stay behind."""
    import errno

    import autosearch.export as exporting
    from autosearch.core import _files

    real, calls = exporting.atomic_write, []

    def filling(path, data, **kw):
        calls.append(path)
        if len(calls) == 3:
            raise SpecError(f"cannot write {path!r}: No space left on device")
        real(path, data, **kw)

    monkeypatch.setattr(exporting, "atomic_write", filling)
    strategy = Strategy(dp=8, global_batch_size=64)
    with pytest.raises(SpecError, match="No space left.*the files this export added were removed"):
        exporting.write_exports(tmp_path / "e", strategy)
    assert not (tmp_path / "e").exists()

    # ... and when even the folder's marker cannot be written
    class FullDisk:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(exporting, "atomic_write", real)
    monkeypatch.setattr(_files, "os", FullDisk())
    with pytest.raises(SpecError, match="No space left on device.*disk is full"):
        exporting.write_exports(tmp_path / "f" / "g", strategy)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


# ---- hybrids (issue 33): MambaModel by pretrain_mamba.py, Gated DeltaNet through GPTModel ------
def _hybrid_args(name: str, strategy: Strategy | None = None):
    spec = ModelSpec.load(name)
    out = export(strategy or Strategy(dp=1, global_batch_size=1), to="megatron", model=spec)
    return out, megatron_parser().parse_args(shlex.split(out.text.replace("\\\n", " "))), spec


@pytest.mark.parametrize(
    "name", ["nemotron-h-8b", "nemotron-3-nano-30b-a3b", "granite-4.0-h-small"]
)
def test_a_mamba_hybrid_exports_megatrons_mamba_model(name):
    """pretrain_mamba.py, one Megatron layer per symbol of the hybrid pattern (Nemotron-H 8B:
    28 blocks, 52 layers as in the Nemotron-H report's Table 1), the Mamba-2 mixer's four
    fields, the layer spec, no position embedding, and no --moe-layer-freq (the E's place the
    experts)."""
    out, a, spec = _hybrid_args(name)
    assert a.script == "pretrain_mamba.py" and not out.refused
    assert a.hybrid_override_pattern == spec.pattern and a.num_layers == len(spec.pattern)
    assert (a.mamba_state_dim, a.mamba_head_dim, a.mamba_num_groups, a.mamba_num_heads) == (
        spec.mamba.d_state,
        spec.mamba.head_dim,
        spec.mamba.n_groups,
        spec.mamba.n_heads,
    )
    assert a.spec == ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
    assert a.position_embedding_type == "none" and a.moe_layer_freq is None
    assert (a.num_experts is not None) == (spec.moe is not None)
    if name == "nemotron-h-8b":
        assert a.num_layers == 52
    assert "pretrain_mamba.py" in out.script


def test_a_gated_deltanet_hybrid_exports_gpt_models_linear_attention():
    """Qwen3-Next: GPTModel with the gated_delta_net attention variant, 1 for each Gated
    DeltaNet layer of --linear-attention-freq, the linear heads, the output gate."""
    out, a, spec = _hybrid_args("qwen3-next-80b-a3b")
    assert a.script == "pretrain_gpt.py" and not out.refused
    assert a.experimental_attention_variant == "gated_delta_net"
    assert eval(a.linear_attention_freq) == [1, 1, 1, 0] * 12  # as Megatron-LM evaluates it
    assert (a.linear_num_key_heads, a.linear_num_value_heads) == (16, 32)
    assert (a.linear_key_head_dim, a.linear_value_head_dim, a.linear_conv_kernel_dim) == (
        128,
        128,
        4,
    )
    assert a.attention_output_gate and a.qk_layernorm and a.rotary_percent == 0.25
    assert a.num_layers == spec.n_layers == 48


def test_a_hybrid_pipeline_split_is_counted_in_megatron_layers():
    """MambaModel splits its Megatron layers (symbols) evenly over pp: Nemotron-H 8B's 28 blocks
    split 14 / 14 are 26 / 26 layers (even, taken); an uneven split is refused, not mis-said."""
    even = Strategy(dp=1, pp=2, global_batch_size=8)
    out, a, _ = _hybrid_args("nemotron-h-8b", even)
    assert not any(f == "pipeline_split" for f, _ in out.unsupported)
    assert a.decoder_first_pipeline_num_layers is None
    uneven = Strategy(dp=1, pp=2, global_batch_size=8, pipeline_split=(10, 18))
    spec = ModelSpec.load("nemotron-h-8b")
    out = export(uneven, to="megatron", model=spec, allow_unsupported=True)
    why = dict(out.unsupported)["pipeline_split"]
    assert "52 Megatron layers" in why and "[18, 34]" in why


@pytest.mark.parametrize("target", ["torchtitan", "deepspeed"])
def test_frameworks_without_hybrid_layers_refuse_them_by_name(target):
    one = Strategy(dp=1, global_batch_size=1)
    for name, lacks in (
        ("nemotron-h-8b", ("layer_pattern", "mamba")),
        ("qwen3-next-80b-a3b", ("layer_pattern", "gdn", "attention_output_gate")),
    ):
        out = export(one, to=target, model=ModelSpec.load(name), allow_unsupported=True)
        refused = dict(out.refused)
        assert set(lacks) <= set(refused), (name, refused)
        assert all(refused[f] for f in lacks)
        with pytest.raises(SpecError, match="mamba|gdn|layer_pattern"):
            export(one, to=target, model=ModelSpec.load(name))


@pytest.mark.skipif(_package_dir("megatron") is None, reason="megatron-core is not installed")
def test_the_hybrid_export_is_what_megatron_cores_mamba_model_reads():
    """Run where megatron-core is installed (pip install --no-deps megatron-core; read with ast,
    not imported): the pattern's symbols are Megatron's (ssm/mamba_hybrid_layer_allocation.py
    Symbols), MambaModel takes the hybrid pattern and a position type of none, the layer spec
    the export names exists, and GPTModel's linear attention reads the flags given."""
    import ast

    root = os.path.join(_package_dir("megatron"), "core")

    def parse(rel):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            text = f.read()
        return text, ast.parse(text)

    text, tree = parse("ssm/mamba_hybrid_layer_allocation.py")
    symbols = next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Symbols"
    )
    values = {
        s.value.value
        for s in symbols.body
        if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)
    }
    for name in ("nemotron-h-56b", "nemotron-3-nano-30b-a3b", "granite-4.0-h-small"):
        _, a, _ = _hybrid_args(name)
        assert set(a.hybrid_override_pattern) <= values
    _, tree = parse("models/mamba/mamba_model.py")
    init = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    assert {"hybrid_override_pattern", "position_embedding_type"} <= {
        x.arg for x in init.args.args
    }
    assert "'none'" in ast.unparse(init) or '"none"' in ast.unparse(init)
    module, name = export_mamba_spec()
    text, _ = parse(module.removeprefix("megatron.core.").replace(".", "/") + ".py")
    assert f"\n{name} = ModuleSpec(" in text
    text, _ = parse("models/gpt/experimental_attention_variant_module_specs.py")
    assert "def get_linear_attention_pattern" in text and "gated_delta_net" in text


def export_mamba_spec() -> tuple[str, str]:
    from autosearch.export._megatron import MAMBA_SPEC

    module, name = MAMBA_SPEC.split()
    return module, name
