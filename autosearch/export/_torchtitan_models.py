"""torchtitan's models for a ModelSpec: the shipped model and flavor with its shape, else a
flavor of its own registered by a small Python module (`[experimental] custom_import`), else
the fields torchtitan cannot build.

torchtitan 0.2.2 (`torchtitan/models/<name>/__init__.py`, `<name>_args`) ships llama3, llama4,
qwen3, deepseek_v3 and gpt_oss; a job names one by ``[model] name`` and ``flavor``, and the
flavor's model arguments fix the whole shape (the TOML holds no model argument).
`torchtitan/train.py` imports ``experimental.custom_import`` before it looks the flavor up, so a
module that adds an entry to ``qwen3_args`` or ``deepseekv3_args`` gives any shape those
families can build. tests/test_export_frameworks.py builds each on the meta device and counts
its parameters against the ModelSpec's.
"""

from __future__ import annotations

from typing import Any

from autosearch.export._architecture import MODEL_FIELDS, Architecture
from autosearch.export._base import FieldMap, one_line

# The dict of flavors of each family torchtitan 0.2.2 looks a flavor up in
# (`torchtitan/models/<family>/__init__.py`): note deepseek_v3's has no underscore.
ARGS_DICT = {"qwen3": "qwen3_args", "deepseek_v3": "deepseekv3_args"}
# The flavor torchtitan_flavor.py registers: a fixed name, so the model's name is only ever in
# comments of the files written.
FLAVOR = "autosearch"

_DS_YARN: tuple[tuple[str, Any], ...] = (
    ("type", "yarn"),
    ("factor", 40.0),
    ("original_max_position_embeddings", 4096),
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
)


def _sig(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        n_kv_heads=None,
        head_dim=None,
        tied=False,
        rope_scaling=(),
        qk_norm=None,
        norm_eps=1e-5,
        moe=None,
        mla=None,
        nope_layer_step=None,
        attention_chunk=None,
    )
    base.update(kw)
    if base["n_kv_heads"] is None:
        base["n_kv_heads"] = base["n_heads"]
    if base["head_dim"] is None and base["mla"] is None:
        base["head_dim"] = base["hidden_size"] // base["n_heads"]
    return base


_LLAMA31 = (
    ("type", "llama3"),
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192),
)
_QWEN3 = dict(rope_base=1e6, qk_norm="rmsnorm", norm_eps=1e-6, vocab_size=151936, head_dim=128)

# (model name, flavor) -> the shape its model arguments give, in ModelSpec's words. Transcribed
# from torchtitan 0.2.2 (llama3: the MLP width of FeedForward's formula and the Llama 3.1
# RoPEScalingArgs every flavor has; llama4: auto_scale_hidden_dim's expert width; deepseek_v3:
# its MLA, YaRN and mscale), checked against the installed package by
# tests/test_export_frameworks.py. MoE: (experts, top_k, expert width, shared experts, their
# total width, first dense layers, layer step, router); MLA: (q rank, kv rank, nope, rope, v).
FLAVORS: dict[tuple[str, str], dict[str, Any]] = {
    ("llama3", "8B"): _sig(
        hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_size=14336,
        vocab_size=128256, rope_base=500000.0, rope_scaling=_LLAMA31,
    ),
    ("llama3", "70B"): _sig(
        hidden_size=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_size=28672,
        vocab_size=128256, rope_base=500000.0, rope_scaling=_LLAMA31,
    ),
    ("llama3", "405B"): _sig(
        hidden_size=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden_size=53248,
        vocab_size=128256, rope_base=500000.0, rope_scaling=_LLAMA31,
    ),
    ("qwen3", "8B"): _sig(
        hidden_size=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_size=12288, **_QWEN3
    ),
    ("qwen3", "32B"): _sig(
        hidden_size=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_size=25600, **_QWEN3
    ),
    ("qwen3", "30B-A3B"): _sig(
        hidden_size=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden_size=6144,
        moe=(128, 8, 768, 0, 0, 0, 1, "softmax"), **_QWEN3,
    ),
    ("qwen3", "235B-A22B"): _sig(
        hidden_size=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden_size=12288,
        moe=(128, 8, 1536, 0, 0, 0, 1, "softmax"), **{**_QWEN3, "rope_base": 5e6},
    ),
    ("deepseek_v3", "236B"): _sig(
        hidden_size=5120, n_layers=60, n_heads=128, ffn_hidden_size=12288, vocab_size=102400,
        moe=(160, 6, 1536, 2, 3072, 1, 1, "softmax"), mla=(1536, 512, 128, 64, 128),
        rope_base=10000.0, norm_eps=1e-5,
        rope_scaling=_DS_YARN + (("mscale", 1.0), ("mscale_all_dim", 1.0)),
    ),
    ("deepseek_v3", "671B"): _sig(
        hidden_size=7168, n_layers=61, n_heads=128, ffn_hidden_size=18432, vocab_size=129280,
        moe=(256, 8, 2048, 1, 2048, 3, 1, "sigmoid"), mla=(1536, 512, 128, 64, 128),
        rope_base=10000.0, norm_eps=1e-5,
        rope_scaling=_DS_YARN + (("mscale", 1.0), ("mscale_all_dim", 1.0)),
    ),
    ("llama4", "17bx16e"): _sig(
        hidden_size=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_hidden_size=16384,
        vocab_size=202048, rope_base=500000.0, rope_scaling=_LLAMA31,
        moe=(16, 1, 8192, 1, 8192, 0, 1, "sigmoid"),
    ),
    ("llama4", "17bx128e_irope"): _sig(
        hidden_size=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_hidden_size=16384,
        vocab_size=202048, rope_base=500000.0, moe=(128, 1, 8192, 1, 8192, 0, 2, "sigmoid"),
        nope_layer_step=4, attention_chunk=8192,
    ),
}  # fmt: skip


def signature(model, arch: Architecture) -> dict[str, Any]:
    """`model` in the words of `FLAVORS`."""
    moe = model.moe
    return _sig(
        hidden_size=model.hidden_size,
        n_layers=model.n_layers,
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        head_dim=None if model.mla is not None else model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size,
        vocab_size=model.vocab_size,
        tied=model.tied_embeddings,
        rope_base=arch.rope_base,
        rope_scaling=arch.rope_scaling,
        qk_norm=arch.qk_norm,
        norm_eps=arch.norm_eps,
        moe=None
        if moe is None
        else (
            moe.n_experts,
            moe.top_k,
            moe.ffn_hidden_size,
            moe.n_shared_experts,
            moe.n_shared_experts * moe.shared_ffn_hidden_size,
            moe.first_dense_layers,
            moe.layer_step,
            moe.router,
        ),
        mla=None
        if model.mla is None
        else (
            model.mla.q_lora_rank,
            model.mla.kv_lora_rank,
            model.mla.qk_nope_head_dim,
            model.mla.qk_rope_head_dim,
            model.mla.v_head_dim,
        ),
        nope_layer_step=arch.nope_layer_step,
        attention_chunk=arch.attention_chunk,
    )


def shipped_flavor(model, arch: Architecture) -> tuple[str, str] | None:
    """The torchtitan (model, flavor) whose arguments build `model`, or None."""
    if not _plain(model, arch):
        return None
    sig = signature(model, arch)
    return next((key for key, shape in FLAVORS.items() if shape == sig), None)


def _plain(model, arch: Architecture) -> bool:
    """What every torchtitan LLM here builds: RoPE, SwiGLU, RMSNorm, no biases or dropout."""
    return (
        model.position_embedding == "rotary"
        and model.ffn_activation == "swiglu"
        and not model.linear_bias
        and not model.dropout
        and not model.sliding_layers
        and model.attn_logit_softcapping is None
        and model.final_logit_softcapping is None
        and model.lora is None
        and not (model.moe is not None and model.moe.capacity_factor is not None)
        and not (arch.qkv_bias or arch.post_norms or arch.attention_sinks)
        and arch.swiglu_limit is None
        and not arch.shared_expert_gate
    )


def model_section(model, arch: Architecture) -> tuple[dict[str, Any], str, FieldMap, list[str]]:
    """The ``[model]`` keys for `model`, the text of `torchtitan_flavor.py` ("" when a shipped
    flavor fits), what each model field became, and notes."""
    m, notes = FieldMap(), []
    refuse_common(model, arch, m)
    shipped = shipped_flavor(model, arch)
    family = "deepseek_v3" if model.mla is not None else "qwen3"
    if shipped is not None:
        name, flavor = shipped
        module = ""
        where = f"[model] name = {name!r}, flavor = {flavor!r}"
    else:
        name, flavor = family, FLAVOR
        module = flavor_module(model, arch, family, m)
        where = f"{ARGS_DICT[family]}[{FLAVOR!r}] in torchtitan_flavor.py"
    for field in MODEL_FIELDS:
        if field not in m.refused:
            m.set(field, where)
    if module and not arch.known:
        notes.append(
            f"{model.name} is not a catalog model: its RoPE base, norm epsilon and QK norm are "
            "not in its ModelSpec, so torchtitan_flavor.py gives 10000, 1e-5 and none; set "
            "your model's there"
        )
    if model.mtp_layers:
        m.refuse(
            "mtp_layers",
            f"torchtitan 0.2's models train no multi-token prediction module "
            f"({model.mtp_layers} planned)",
        )
    if model.moe is not None:
        notes.append(
            "MoE routing beyond the ModelSpec (top-k renormalization, expert groups, route "
            "scale, load-balancing coefficient) is torchtitan's default or the shipped flavor's"
        )
    keys: dict[str, Any] = {"name": name, "flavor": flavor}
    return keys, module, m, notes


def refuse_common(model, arch: Architecture, m: FieldMap) -> None:
    """The fields no torchtitan 0.2 LLM builds (so neither a shipped nor an own flavor)."""
    if model.position_embedding != "rotary":
        m.refuse("position_embedding", f"{model.position_embedding}: torchtitan's LLMs use RoPE")
    if model.ffn_activation != "swiglu":
        m.refuse("ffn_activation", f"{model.ffn_activation}: torchtitan's MLPs are SwiGLU")
    if model.linear_bias:
        m.refuse("linear_bias", "torchtitan's llama3/qwen3/deepseek_v3 have no linear biases")
    if model.is_gpt_style:
        m.refuse("arch.norm_eps", "LayerNorm: torchtitan's LLMs use RMSNorm")
    if model.dropout:
        m.refuse("dropout", "torchtitan's models have no dropout")
    if model.sliding_layers:
        m.refuse("sliding_window", "only gpt_oss has sliding windows, with its own shape")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(model, name) is not None:
            m.refuse(name, "torchtitan's models have no logit soft-capping")
    for name, on, why in (
        ("arch.qkv_bias", arch.qkv_bias, "qwen3's attention has no QKV biases"),
        ("arch.post_norms", arch.post_norms, "no norms after attention and MLP"),
        ("arch.attention_sinks", arch.attention_sinks, "gpt_oss has sinks, with biases"),
        ("arch.swiglu_limit", arch.swiglu_limit is not None, "gpt_oss's clamp, with biases"),
        ("arch.shared_expert_gate", arch.shared_expert_gate, "torchtitan's MoE has no gate"),
        ("arch.nope", arch.nope, "torchtitan's LLMs put RoPE on every attention layer"),
    ):
        if on:
            m.refuse(name, why)
    if model.lora is not None:
        m.refuse("lora", "torchtitan 0.2 trains every weight (no LoRA)")
    if any(layer.mixer != "attention" or layer.mlp == "none" for layer in model.layers):
        m.refuse(
            "layer_pattern", f"{model.pattern[:40]}: torchtitan 0.2's LLMs are attention + MLP"
        )
    if model.mamba is not None:
        m.refuse("mamba", "torchtitan 0.2 has no Mamba-2 layers")
    if model.gdn is not None:
        m.refuse("gdn", "torchtitan 0.2 has no Gated DeltaNet layers")
    if model.mamba1 is not None:
        m.refuse("mamba1", "torchtitan 0.2 has no Mamba-1 layers")
    if model.attention_output_gate:
        m.refuse("attention_output_gate", "torchtitan 0.2's attention has no output gate")
    if model.moe is not None and model.moe.capacity_factor is not None:
        m.refuse("moe.capacity_factor", "torchtitan's MoE is dropless")


def flavor_module(model, arch: Architecture, family: str, m: FieldMap) -> str:
    """torchtitan_flavor.py: a flavor named after `model` in `family`'s argument table, or the
    fields that family cannot take (refused in `m`)."""
    moe = model.moe
    if arch.rope_scaling and not (family == "deepseek_v3" and arch.scaling["type"] == "yarn"):
        m.refuse(
            "arch.rope_scaling",
            f"{family}'s arguments take no {arch.scaling['type']} RoPE scaling",
        )
    if arch.qk_norm == "l2":
        m.refuse("arch.qk_norm", "qwen3's QK norm is an RMSNorm with weights, not L2")
    if arch.nope_layer_step or arch.attention_chunk:
        m.refuse("arch.nope_layer_step", "only llama4's shipped iRoPE flavors skip RoPE")
    if moe is not None and moe.layer_step > 1:
        m.refuse("moe.layer_step", f"{family} puts experts in every layer")
    if moe is not None and moe.first_dense_layers and family == "qwen3":
        m.refuse("moe.first_dense_layers", "qwen3 puts experts in every layer")
    if (
        moe is not None
        and moe.n_shared_experts
        and moe.shared_ffn_hidden_size % moe.ffn_hidden_size
    ):
        m.refuse(
            "moe.shared_ffn_hidden_size",
            "torchtitan's shared experts are n x the expert width "
            f"({moe.ffn_hidden_size}), not {moe.shared_ffn_hidden_size}",
        )
    if family == "deepseek_v3" and model.tied_embeddings:
        m.refuse("tied_embeddings", "deepseek_v3 has no weight tying")
    base = arch.rope_base if arch.rope_base is not None else 10000.0
    moe_args = ""
    if moe is not None:
        shared = moe.n_shared_experts * moe.shared_ffn_hidden_size // moe.ffn_hidden_size
        moe_args = (
            f"MoEArgs(num_experts={moe.n_experts!r}, num_shared_experts={shared!r}, "
            f"top_k={moe.top_k!r}, score_func={moe.router!r}, route_norm=True, "
            "score_before_experts=False)"
        )
    if family == "qwen3":
        args = dict(
            dim=model.hidden_size,
            n_layers=model.n_layers,
            n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads,
            vocab_size=model.vocab_size,
            head_dim=model.head_dim,
            hidden_dim=model.ffn_hidden_size,
            norm_eps=arch.norm_eps,
            rope_theta=base,
            qk_norm=arch.qk_norm == "rmsnorm",
            max_seq_len=model.seq_len,
            enable_weight_tying=model.tied_embeddings,
            moe_enabled=moe is not None,
        )
        if moe is not None:
            args["moe_inter_dim"] = moe.ffn_hidden_size
        cls = "Qwen3ModelArgs"
    else:
        mla, scaling = model.mla, arch.scaling
        args = dict(
            vocab_size=model.vocab_size,
            dim=model.hidden_size,
            inter_dim=model.ffn_hidden_size,
            moe_inter_dim=moe.ffn_hidden_size if moe is not None else model.ffn_hidden_size,
            n_layers=model.n_layers,
            n_dense_layers=moe.first_dense_layers if moe is not None else model.n_layers,
            n_heads=model.n_heads,
            norm_eps=arch.norm_eps,
            q_lora_rank=mla.q_lora_rank or 0,
            kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            max_seq_len=model.seq_len,
            rope_theta=base,
        )
        if scaling.get("type") == "yarn":  # torchtitan's mscale is Hugging Face's mscale_all_dim
            args.update(
                original_seq_len=scaling["original_max_position_embeddings"],
                rope_factor=scaling["factor"],
                beta_fast=int(scaling["beta_fast"]),
                beta_slow=int(scaling["beta_slow"]),
                mscale=scaling.get("mscale_all_dim", 1.0),
            )
        cls = "DeepSeekV3ModelArgs"
    lines = [f"{key}={value!r}," for key, value in args.items()]
    if moe_args:
        lines.append(f"moe_args={moe_args},")
    body = "\n".join("    " + line for line in lines)
    module_path = {"qwen3": "qwen3.model.args", "deepseek_v3": "deepseek_v3.model.args"}[family]
    return (
        f"# torchtitan flavor {FLAVOR!r}: the shape planned for {one_line(model.name)}\n"
        f"# registered in {ARGS_DICT[family]} before torchtitan/train.py looks it up\n"
        "# ([experimental] custom_import in torchtitan.toml).\n\n"
        "from torchtitan.models.moe import MoEArgs  # noqa: F401\n"
        f"from torchtitan.models.{family} import {ARGS_DICT[family]}\n"
        f"from torchtitan.models.{module_path} import {cls}\n\n"
        f"{ARGS_DICT[family]}[{FLAVOR!r}] = {cls}(\n{body}\n)\n"
    )
