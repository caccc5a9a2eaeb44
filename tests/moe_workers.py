"""Multi-process helpers for the mixture-of-experts Engine tests (tests/test_engine_moe.py and
tests/test_engine_moe2.py).

The jobs run in the gloo workers of `engine_workers` (its launcher, with these jobs added):
tiny MoE models of the reference transformer and of transformers' Mixtral and Qwen3-MoE.
"""

from __future__ import annotations

import engine_workers as W
import torch

# The shapes of engine_workers' "llama" with 4 experts in layers 1-3 (layer 0 dense, as
# DeepSeek's first_k_dense_replace): top-2 softmax with a shared expert (DeepSeek/Qwen2-MoE
# style), and top-2 sigmoid (DeepSeek-V3's router) without one.
MOE = W.MODELS["llama"].scaled(
    moe={
        "n_experts": 4,
        "top_k": 2,
        "ffn_hidden_size": 64,
        "n_shared_experts": 1,
        "first_dense_layers": 1,
    }
)
MODELS = {
    "moe": MOE,
    "moe_kv4": MOE.scaled(n_kv_heads=4),  # tp=4 (1 < etp < tp) needs tp to divide the kv heads
    "moe_sigmoid": W.MODELS["llama"].scaled(
        moe={"n_experts": 4, "top_k": 2, "ffn_hidden_size": 64, "router": "sigmoid"}
    ),
}
# Tiny Mixtral and Qwen3-MoE (engine_workers.HF_SHAPE, 4 experts of width 64, top 2).
HF_MOE = {
    "hf_mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "hf_qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "moe_intermediate_size": 64, "norm_topk_prob": True, "head_dim": 16},
    ),
}

# "<kind>_aux": transformers' load-balancing loss at 0.1 instead of the configs' 1e-3, which moves
# 3 steps' losses by less than the fp32 tolerance (2.6e-4 for Qwen3-MoE): a lost aux gradient
# must show (the pipeline runs, whose stages pass the loss's sums on).
AUX_COEF = 0.1


def make_model(kind: str):
    torch.manual_seed(1234)
    base = kind.removesuffix("_aux")
    if base in HF_MOE:
        import transformers

        config_name, model_name, extra = HF_MOE[base]
        if kind != base:
            extra = {**extra, "router_aux_loss_coef": AUX_COEF}
        config = getattr(transformers, config_name)(
            **W.HF_SHAPE, num_experts_per_tok=2, output_router_logits=True, **extra
        )
        return getattr(transformers, model_name)(config)
    from autosearch.models.transformer import Transformer

    return Transformer(MODELS[kind])


def train_losses(
    strategy: str, kind: str, *, meta_init: bool = False, clip: float | None = None
) -> dict:
    """Per-step losses (and gradient norms, before clipping at `clip`) of `W.STEPS` AdamW steps
    from a fixed seed and data order, and the load-balancing losses of the last forward (the
    reference transformer's per layer, "aux"; transformers' whole-model one, "hf_aux")."""
    from autosearch import Engine
    from autosearch.engine import SyntheticTokens
    from autosearch.models.hf.causal_lm import HFCausalLM
    from autosearch.models.moe import moe_layers

    kwargs = dict(
        optimizer=lambda p: torch.optim.AdamW(p, lr=W.LR), strategy=strategy, grad_clip_norm=clip
    )
    if meta_init:
        engine = Engine(lambda: make_model(kind), meta_init=True, seed=0, **kwargs)
    else:
        engine = Engine(lambda: make_model(kind), seed=0, **kwargs)
    data = SyntheticTokens.for_model(W.MODELS["llama"], 64, seed=0)
    loader = engine.dataloader(data, mode="train", steps_per_epoch=W.STEPS)
    engine.prepare(mode="train")
    logs = [engine.run(batch, mode="train") for batch in loader]
    losses = [r["loss"] for r in logs]
    aux = [
        float(m.aux_loss)
        for p in engine.model_parts_
        for m in moe_layers(p)
        if m.aux_loss is not None
    ]
    # transformers' aux loss of the last forward (on the last pipeline stage only)
    hf_aux = [
        float(m.aux_loss)
        for p in engine.model_parts_
        for m in p.modules()
        if isinstance(m, HFCausalLM) and hasattr(m, "aux_loss")
    ]
    return {
        "loss": losses,
        "aux": aux,
        "hf_aux": hf_aux,
        "grad_norm": [r.get("grad_norm") for r in logs],
    }


def job_equivalence(cases: list[dict]) -> dict:
    return {
        c["name"]: train_losses(c["strategy"], c["model"], meta_init=c["meta"], clip=c["clip"])
        for c in cases
    }


def job_checkpoint(workdir: str, saved: str, others: dict, global_batch: int) -> dict:
    """Train 2 steps under strategy `saved` and save; engines of the `others` strategies ({name:
    strategy}) load the checkpoint and must evaluate to the same loss (the experts, DTensors
    over ep or (ep, etp), are whole weights in the checkpoint)."""
    import os

    from autosearch import Engine
    from autosearch.engine import SyntheticTokens

    data = SyntheticTokens.for_model(W.MODELS["llama"], 16, seed=0)
    valid = SyntheticTokens.for_model(W.MODELS["llama"], 8, seed=7)
    batch = f"micro_batch_size=2,global_batch_size={global_batch},amp=fp32"

    def engine(strategy):
        return Engine(
            lambda: make_model("moe"),
            optimizer=lambda p: torch.optim.AdamW(p, lr=W.LR),
            strategy=f"{strategy},{batch}",
            seed=0,
        )

    e = engine(saved)
    e.fit(data, steps_per_epoch=2, verbose=0)
    e.save(os.path.join(workdir, "saved"))
    out = {"saved": e.evaluate(valid, verbose=0)["loss"]}
    for name, strategy in others.items():
        other = engine(strategy)
        out[f"{name}_fresh"] = other.evaluate(valid, verbose=0)["loss"]
        other.load(os.path.join(workdir, "saved"))
        out[name] = other.evaluate(valid, verbose=0)["loss"]
    return out


JOBS = {"moe_equivalence": job_equivalence, "moe_checkpoint": job_checkpoint}


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
