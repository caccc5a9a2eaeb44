"""LoRA under the Engine through peft (autosearch/engine/lora.py), on CPU.

One process: the optimizer holds the adapters only (as many as `LoraSpec.layer_params` counts),
the frozen weights do not move, B = 0 makes the first loss bitwise that of the model without
adapters, and saved adapters load back into a fresh model with the same loss. Two gloo processes
(DDP, FSDP2 with frozen and trainable parameters in one group, two pipeline stages, context
parallel under FSDP2, and FSDP2 on a Hugging Face Llama) match the
single-process run with tests/test_engine_parallel.py's fp32 tolerances: 2e-5 on the first two
losses, 1e-3 over the three (reordered reductions; a missing gradient average moves the
second loss by 1e-2 or more).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
import engine_workers as W  # noqa: E402
import lora_workers as L  # noqa: E402

from autosearch.core import SpecError, Strategy  # noqa: E402

B = "micro_batch_size=2,global_batch_size=8,amp=fp32"
FP32 = (2e-5, 1e-3)  # tests/test_engine_parallel.py
PARALLEL = {  # name: (strategy, model)
    "dp2": (f"dp=2,{B}", "llama"),
    "dp2_zero3": (f"dp=2,zero_stage=3,{B}", "llama"),
    "pp2": (f"pp=2,{B}", "llama"),
    "cp2_zero3": (f"cp=2,zero_stage=3,{B}", "llama"),  # the 70B one-node pick's layout
    "hf_dp2_zero3": (f"dp=2,zero_stage=3,{B}", "hf_llama"),
}


def _engine(spec_targets=None, strategy=B):
    from autosearch import Engine

    torch.set_num_threads(1)
    model = L.make_model("llama", spec_targets)
    engine = Engine(model, optimizer=lambda p: torch.optim.AdamW(p, lr=L.LR), strategy=strategy)
    loader = engine.dataloader(W.dataset("llama"), mode="train", steps_per_epoch=W.STEPS)
    engine.prepare(mode="train")
    return engine, loader


def test_only_adapters_train_and_b_zero_keeps_the_model():
    engine, loader = _engine()
    part = engine.trainer_.model_parts[0]
    spec = L.lora_spec()
    groups = [g for o in engine.trainer_.optimizers for g in o.param_groups]
    optimized = [p for g in groups for p in g["params"]]
    assert sum(p.numel() for p in optimized) == spec.lora.layer_params(spec) * spec.n_layers
    frozen = {n: p.detach().clone() for n, p in part.named_parameters() if not p.requires_grad}
    assert sum(p.numel() for p in frozen.values()) == spec.n_params
    losses = [engine.run(b, mode="train")["loss"] for b in loader]
    assert losses[-1] < losses[0] - 0.02, losses
    for n, p in part.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen {n} moved"
    # the same model without adapters: B = 0 adds exactly zero to every targeted output
    from autosearch import Engine
    from autosearch.models.transformer import Transformer

    torch.manual_seed(1234)
    dense = Transformer(W.MODELS["llama"])
    plain = Engine(dense, optimizer=torch.optim.AdamW(dense.parameters(), lr=L.LR), strategy=B)
    first = next(iter(plain.dataloader(W.dataset("llama"), mode="train", steps_per_epoch=1)))
    plain.prepare(mode="train")
    assert plain.run(first, mode="train")["loss"] == losses[0]


def test_adapters_save_and_load(tmp_path):
    import json

    engine, loader = _engine()
    for b in loader:
        engine.run(b, mode="train")
    engine.save_adapters(str(tmp_path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == ["w1", "w2", "w3", "wk", "wo", "wq", "wv"]
    batch = next(iter(engine.dataloader(W.dataset("llama", seed=5), mode="eval")))
    trained = engine.run(batch, mode="eval")["loss"]
    fresh, _ = _engine()
    before = fresh.run(batch, mode="eval")["loss"]
    assert fresh.load_adapters(str(tmp_path)) == 2 * 7 * W.MODELS["llama"].n_layers
    after = fresh.run(batch, mode="eval")["loss"]
    assert after == trained and before != trained


def test_partial_targets_and_refusals():
    engine, _ = _engine(spec_targets=["q", "v"])
    names = [n for n, p in engine.trainer_.model_parts[0].named_parameters() if p.requires_grad]
    assert {n.split(".")[3] for n in names} == {"wq", "wv"}
    from autosearch.engine.lora import lora_problems, target_modules

    with pytest.raises(SpecError, match="fused matrices.*target q, k, v instead"):
        target_modules(L.make_model(), L.lora_spec(targets=["qkv"]).lora)
    (tp,) = lora_problems(Strategy.parse(f"tp=2,{B}"))
    assert "tp=2 with LoRA" in tp and "use tp=1" in tp
    with pytest.raises(SpecError, match="meta_init with lora"):
        from autosearch import Engine

        Engine(L.make_model, meta_init=True, strategy=B).prepare()


def test_hugging_face_llama_gets_adapters_from_the_model_spec():
    from autosearch import Engine

    torch.set_num_threads(1)
    spec = W.MODELS["llama"].scaled(lora={"rank": 4, "targets": ["q", "v", "down"]})
    engine = Engine(L.make_model("hf_llama"), strategy=B, model_spec=spec)
    engine.prepare(mode="train")
    trained = {
        n.split(".")[-4]: p.numel()
        for n, p in engine.trainer_.model_parts[0].named_parameters()
        if p.requires_grad
    }
    assert set(trained) == {"q_proj", "v_proj", "down_proj"}
    part = engine.trainer_.model_parts[0]
    n = sum(p.numel() for p in part.parameters() if p.requires_grad)
    assert n == spec.lora.layer_params(spec) * spec.n_layers


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return {kind: L.lora_losses(B, kind) for kind in ("llama", "hf_llama")}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    cases = [{"name": n, "strategy": s, "kind": k} for n, (s, k) in PARALLEL.items()]
    return L.launch(2, cases, str(root)), root


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARALLEL))
def test_parallel_lora_matches_single_process(world2, reference, name):
    results, root = world2
    kind = PARALLEL[name][1]
    got, ref = results[0][name]["losses"], reference[kind]["losses"]
    assert all(r[name]["losses"] == got for r in results), f"{name}: ranks disagree"
    early = max(abs(a - b) for a, b in zip(got[:2], ref[:2]))
    gap = max(abs(a - b) for a, b in zip(got, ref))
    assert early <= FP32[0] and gap <= FP32[1], (name, got, ref)
    # the optimizer holds adapters only: all of them (dp), half each (FSDP2 shards, pp stages)
    local = [r[name]["optimized_local"] for r in results]
    total = reference[kind]["optimized_local"]
    assert (local == [total, total]) if name == "dp2" else (sum(local) == total), local
    assert (root / name / "adapter_model.safetensors").exists()
