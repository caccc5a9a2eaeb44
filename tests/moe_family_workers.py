"""Multi-process helpers for tests/test_engine_hf_moe_families.py: tiny random transformers
models of the mixture-of-experts families with their own wrapper (Qwen2-MoE, DeepSeek-V2/V3,
gpt-oss, Llama 4 text; autosearch/models/hf/families.py), built from their config classes
(nothing downloaded), trained for `engine_workers.STEPS` AdamW steps in the gloo workers of
`engine_workers` (its launcher, with this module's job added).
"""

from __future__ import annotations

import engine_workers as W
import torch

# 2 layers (pp=2: one per stage), hidden 64, 4 heads, vocabulary 128, 32 positions (the data of
# engine_workers.MODELS["llama"]); 4 or 8 experts of width 32.
SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)
# "<family>": (config class, model class, config keys)
FAMILIES = {
    # every layer sparse, a gated shared expert, q/k/v biases; transformers' aux loss at 0.1
    # (the configs' 1e-3 moves 3 steps' losses by less than the tolerance: a lost aux gradient
    # must show)
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_key_value_heads=2,
            intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=True,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
    ),
    # MLA with a query LoRA, layer 0 dense, sigmoid router with group-limited top-2 (2 of 4
    # groups of 2 experts) and a random e_score_correction_bias (`make_model`)
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            intermediate_size=128,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
    ),
    # MLA without query LoRA (V2-Lite), complex rotary, softmax group-limited greedy routing
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_key_value_heads=4,
            intermediate_size=128,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
    ),
    # attention sinks, sliding (window 16) and full layers, biased experts and router
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
        ),
    ),
    # layer 1 sparse (interleave_moe_layer_step 2) with a shared expert, top-1 sigmoid router;
    # layer 0 chunked attention (chunks of 16) with rope and QK L2 norm, layer 1 full attention
    # without rope (no_rope_layer_interval 2) and attention temperature tuning
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=2,
            attention_chunk_size=16,
            floor_scale=8,
        ),
    ),
}
# Llama 4 without attention temperature tuning: context parallel runs (with it, cp is refused
# once the sequence reaches floor_scale tokens, 8 above)
FAMILIES["llama4_text_untuned"] = (
    "Llama4TextConfig",
    "Llama4ForCausalLM",
    {**FAMILIES["llama4_text"][2], "attn_temperature_tuning": False},
)


def make_model(family: str):
    """A transformers model of `family` with random weights from a fixed seed."""
    import transformers

    torch.manual_seed(1234)
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**SHAPE, **extra)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: make it steer
                buffer.normal_(0.0, 0.1)
    return model


def train_losses(strategy: str, family: str) -> list[float]:
    """Per-step losses of `W.STEPS` AdamW steps from a fixed seed and data order."""
    from autosearch import Engine
    from autosearch.engine import SyntheticTokens

    engine = Engine(
        lambda: make_model(family),
        optimizer=lambda p: torch.optim.AdamW(p, lr=W.LR),
        strategy=strategy,
        seed=0,
    )
    data = SyntheticTokens.for_model(W.MODELS["llama"], 64, seed=0)
    loader = engine.dataloader(data, mode="train", steps_per_epoch=W.STEPS)
    engine.prepare(mode="train")
    return [engine.run(batch, mode="train")["loss"] for batch in loader]


def job_families(cases: list[dict]) -> dict:
    """{case name: losses, or the refusal "SpecError: ..."} for each case."""
    from autosearch import SpecError

    out: dict = {}
    for case in cases:
        try:
            out[case["name"]] = train_losses(case["strategy"], case["family"])
        except SpecError as exc:
            out[case["name"]] = f"SpecError: {exc}"
    return out


JOBS = {"moe_families": job_families}


def _entry(*args) -> None:
    W.JOBS.update(JOBS)
    W._entry(*args)


def launch(world: int, job: str, *args, timeout_s: float = 300.0) -> list[dict]:
    """`engine_workers.launch` with this module's jobs."""
    entry = W._entry
    W._entry = _entry  # the spawned processes start here, then run engine_workers' entry
    try:
        return W.launch(world, job, *args, timeout_s=timeout_s)
    finally:
        W._entry = entry
