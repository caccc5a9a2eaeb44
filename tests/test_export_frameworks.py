"""The exports checked by the frameworks' own code (issue 31, item 2): Megatron-Core builds
TransformerConfig and GPTModel from the exported Megatron-LM arguments, torchtitan parses the
TOML with its own ConfigManager and builds the model and flavor it names, DeepSpeed parses
ds_config.json with DeepSpeedConfig. Each model is built on the meta device (shapes, no memory)
with a few layers (`few_layers`: every kind of layer it has), in a child process (one gloo
process group), and its parameter count is compared with the
ModelSpec's plus what the ModelSpec leaves out (`expected_extra`: vocabulary padding, QK-norm
weights, QKV biases, the MTP modules, the shared-expert gate).

Needs the `verify` extra (pip install -e '.[verify]'); each test is skipped, with the reason,
where its framework is not installed. `python tests/test_export_frameworks.py` prints the table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autosearch import ModelSpec, Strategy  # noqa: E402
from autosearch.core.model_spec import model_catalog  # noqa: E402
from autosearch.export import architecture_of, export  # noqa: E402
from autosearch.export._architecture import padded_vocab  # noqa: E402

CATALOG = sorted(model_catalog())
ONE = Strategy(dp=1, global_batch_size=1)


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is not there either
        return False


def few_layers(model: ModelSpec) -> ModelSpec:
    """`model` with the fewest layers that hold each kind it has: the dense lead-in, then a
    whole MoE period (counts per layer scale with the layers). A hybrid (a layer_pattern)
    stays whole: its pattern says each layer."""
    if model.layer_pattern is not None:
        return model
    n = 2
    if model.moe is not None:
        n = max(2, model.moe.first_dense_layers + model.moe.layer_step)
    return model.scaled(n_layers=n)


def expected_extra(model: ModelSpec, runtime: str) -> int:
    """Parameters the framework builds that `ModelSpec.n_params` leaves out, each named."""
    arch, h = architecture_of(model), model.hidden_size
    extra = 0
    if runtime == "megatron":  # the NullTokenizer's vocabulary, padded to a multiple of 128
        pad = padded_vocab(model.vocab_size, 128) - model.vocab_size
        extra += pad * h * (1 if model.tied_embeddings else 2)
        extra += model.mtp_layers * model.mtp_layer_params  # n_params leaves MTP out
        if arch.shared_expert_gate:
            extra += h * model.n_moe_layers  # a 1-wide linear per MoE layer
        if arch.attention_sinks:
            extra += model.n_heads * model.n_layers
    if arch.qk_norm == "rmsnorm":
        extra += 2 * model.head_dim * model.n_layers  # q and k norm weights of head_dim
    if arch.qkv_bias:
        extra += (model.attention_hidden_size + 2 * model.kv_hidden_size) * model.n_layers
    return extra


def buildable(runtime: str) -> list[str]:
    """Catalog models the runtime builds as planned (the others are refused, see
    tests/test_export_fields.py)."""
    out = []
    for name in CATALOG:
        full = ModelSpec.load(name)
        refused = export(ONE, to=runtime, model=full, allow_unsupported=True).refused
        if not refused and (runtime == "torchtitan" or not few_refused(runtime, full)):
            out.append(name)
    return out


def few_refused(runtime: str, full: ModelSpec):
    return export(ONE, to=runtime, model=few_layers(full), allow_unsupported=True).refused


def torchtitan_export(full: ModelSpec):
    """What the test builds: the shipped flavor the full model names (cut to a few layers by
    the builder), else a flavor of the few-layer model's own shape."""
    exported = export(ONE, to="torchtitan", model=full)
    if exported.files:  # a flavor of its own: registered at the few-layer shape
        exported = export(ONE, to="torchtitan", model=few_layers(full))
    return exported


def run_child(kind: str, names: list[str], tmp_path) -> dict[str, int]:
    """Counts built by the framework in a child process, by model name."""
    paths = [ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    res = subprocess.run(
        [sys.executable, __file__, kind, *names],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---- Megatron-Core ------------------------------------------------------------------------------
@pytest.mark.skipif(
    not installed("megatron.core"), reason="megatron-core is not installed (.[verify])"
)
def test_megatron_core_builds_every_buildable_catalog_model_with_its_parameter_count(tmp_path):
    # megatron-core 0.16.1 builds multi-latent attention with TransformerEngine only
    # (MLASelfAttention checks isinstance(linear_proj, TELinear)): MLA models are checked by
    # their config (MLATransformerConfig) below, not built here
    # hybrids (a layer_pattern) build as MambaModel, whose layer spec is TransformerEngine's
    # (mamba_layer_specs.py), or with flash-linear-attention's Gated DeltaNet kernels: their
    # flags are checked against megatron-core's source in tests/test_export.py
    names = [
        n
        for n in buildable("megatron")
        if ModelSpec.load(n).mla is None and ModelSpec.load(n).layer_pattern is None
    ]
    assert {"qwen3-30b-a3b", "gpt3-175b", "mixtral-8x7b", "llama3.1-405b"} <= set(names)
    counts = run_child("megatron", names, tmp_path)
    for name in names:
        model = few_layers(ModelSpec.load(name))
        assert counts[name] == model.n_params + expected_extra(model, "megatron"), name


def megatron_count(text: str) -> int:
    """Megatron-LM's gpt_builder (Megatron-LM core_v0.16.1 gpt_builders.py) on the arguments
    `text`, with the local (non-TransformerEngine) layer specs on the meta device: the config
    from every argument named as a TransformerConfig field, as core_transformer_config_from_args
    does, then GPTModel; returns its parameter count."""
    import dataclasses
    import shlex

    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_decoder_layer_specs,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from tests.test_export import megatron_parser

    parser = megatron_parser()
    a = parser.parse_args(shlex.split(text.replace("\\\n", " ")))
    cls = MLATransformerConfig if a.multi_latent_attention else TransformerConfig
    kw = {
        f.name: getattr(a, f.name)
        for f in dataclasses.fields(cls)
        if getattr(a, f.name, None) is not None
    }
    kw.update(
        layernorm_epsilon=a.norm_epsilon,
        add_bias_linear=not a.disable_bias_linear,
        num_moe_experts=a.num_experts,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        moe_grouped_gemm=False,  # SequentialMLP: the same weights, no grouped-GEMM kernel
        moe_token_dispatcher_type="allgather",  # alltoall makes a CUDA stream; no weights
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    for name in ("moe_layer_freq", "no_rope_freq", "window_size", "window_attn_skip_freq"):
        if kw.get(name) is not None:
            kw[name] = eval(kw[name])  # Megatron-LM's moe_freq_type / tuple_type do the same
    if a.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    if a.squared_relu:
        from megatron.core.activations import squared_relu

        kw.update(activation_func=squared_relu)
    config = cls(**kw)
    if a.num_experts:
        spec = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=a.normalization,
            qk_l2_norm=a.qk_l2_norm,
        )
    else:
        spec = get_gpt_layer_local_spec(
            None,
            False,
            a.qk_layernorm,
            a.multi_latent_attention,
            normalization=a.normalization,
            qk_l2_norm=a.qk_l2_norm,
        )
    mtp = None
    if a.mtp_num_layers:
        last = get_gpt_decoder_layer_specs(
            config, use_transformer_engine=False, normalization=a.normalization
        )[-1]
        mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False)
    # Megatron-LM: NullTokenizer(vocab_size) has vocab_size + 1 tokens, padded to 128 x tp
    vocab = padded_vocab(a.vocab_size + 1, a.make_vocab_size_divisible_by)
    with torch.device("meta"):
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=a.max_position_embeddings,
            share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
            position_embedding_type=a.position_embedding_type,
            rotary_percent=a.rotary_percent or 1.0,
            rotary_base=a.rotary_base or 10000,
            rope_scaling=a.use_rope_scaling,
            mtp_block_spec=mtp,
        )
    return sum(p.numel() for p in model.parameters())


def _megatron_main(names: list[str]) -> dict[str, int]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    # MLA's YaRN embedding asks torch.cuda for its device unless use_cpu_initialization
    # reaches it (megatron-core 0.16.1 multi_latent_attention.py does not pass it): the CPU
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    for name in names:
        text = export(ONE, to="megatron", model=few_layers(ModelSpec.load(name))).text
        out[name] = megatron_count(text)
    return out


# ---- torchtitan ---------------------------------------------------------------------------------
@pytest.mark.skipif(not installed("torchtitan"), reason="torchtitan is not installed (.[verify])")
@pytest.mark.skipif(
    not installed("triton"),
    reason="torchtitan 0.2.2 imports triton (models/moe/kernels.py; 1 GB): pip install triton",
)
def test_torchtitan_parses_the_toml_and_builds_the_model_it_names(tmp_path):
    names = buildable("torchtitan")
    assert {"qwen3-30b-a3b", "llama3.1-8b", "deepseek-v2", "llama4-maverick"} <= set(names)
    counts = run_child("torchtitan", names, tmp_path)
    for name in names:
        model = few_layers(ModelSpec.load(name))
        assert counts[name] == model.n_params + expected_extra(model, "torchtitan"), name


def _torchtitan_main(names: list[str]) -> dict[str, int]:
    """Each export written to a folder, read by torchtitan's ConfigManager (its own TOML
    parser and checks), the flavor module imported as train.py imports it, and the model built
    as train.py builds it (meta device); the flavors named come with their full layer count,
    so a shipped flavor is counted at that size against the full ModelSpec."""
    import importlib

    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    out = {}
    for name in names:
        model = few_layers(ModelSpec.load(name))
        exported = torchtitan_export(ModelSpec.load(name))
        folder = os.path.join(os.getcwd(), name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "torchtitan.toml"), "w") as f:
            f.write(exported.text)
        for filename, text in exported.files:
            with open(os.path.join(folder, filename), "w") as f:
                f.write(text)
        job = ConfigManager().parse_args(
            ["--job.config_file", os.path.join(folder, "torchtitan.toml")]
        )
        if job.experimental.custom_import:
            sys.path.insert(0, folder)
            sys.modules.pop(job.experimental.custom_import, None)
            importlib.import_module(job.experimental.custom_import)
            sys.path.remove(folder)
        spec = get_train_spec(job.model.name)
        args = spec.model_args[job.model.flavor]
        args.update_from_config(job)
        if not job.experimental.custom_import:  # a shipped flavor: its own layers
            args.n_layers = model.n_layers
            if hasattr(args, "n_dense_layers"):
                args.n_dense_layers = min(args.n_dense_layers, model.n_layers)
        with torch.device("meta"):
            built = spec.model_cls(args)
        out[name] = sum(p.numel() for p in built.parameters())
    return out


# ---- DeepSpeed ----------------------------------------------------------------------------------
@pytest.mark.skipif(not installed("deepspeed"), reason="deepspeed is not installed (.[verify])")
def test_deepspeed_parses_ds_config_with_its_own_config_class():
    """DeepSpeedConfig (deepspeed/runtime/config.py) reads the file as deepspeed.initialize
    does, with the world size the strategy's data parallel degree (mpu None: dp = world size /
    nothing else), and runs its batch checks (_batch_assertion)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from tests.test_export import STRATEGIES

    for s in STRATEGIES:
        cfg = json.loads(export(s, to="deepspeed").text)
        cfg["train_batch_size"] //= s.dp  # no process group: DeepSpeedConfig takes one rank
        parsed = DeepSpeedConfig(cfg)
        assert parsed.train_batch_size * s.dp == s.global_batch_size
        assert parsed.train_micro_batch_size_per_gpu == s.micro_batch_size
        assert parsed.gradient_accumulation_steps == s.grad_accum_steps
        assert parsed.zero_optimization_stage == s.zero_stage


if __name__ == "__main__":
    if len(sys.argv) > 2:  # a child of the tests above: counts as JSON on the last line
        main = {"megatron": _megatron_main, "torchtitan": _torchtitan_main}[sys.argv[1]]
        print(json.dumps(main(sys.argv[2:])))
