"""The dimensions of today's stacks in the Engine, in one process: recompute kinds, compile, fp8,
the device each needs, and refusals that leave the model untouched.

Multi-process equivalence (cp, tied embeddings under tp and pp, compile and recompute under
tp/dp/pp) is in test_engine_parity_parallel.py; the CUDA-only paths are at the end, marked `cuda`.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import engine_workers as W  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from autosearch import Engine, SpecError, Strategy  # noqa: E402
from autosearch.core import RUNTIMES  # noqa: E402
from autosearch.core.runtime import RuntimeOptions, device_meets  # noqa: E402
from autosearch.engine.build import strategy_problems  # noqa: E402
from autosearch.engine.parallelize import apply_ac, apply_fp8, op_sac_policy  # noqa: E402
from autosearch.engine.pipeline import split_pipeline  # noqa: E402

B = "micro_batch_size=2,global_batch_size=8,amp=fp32"
# Reordered fp32 arithmetic (test_engine_parallel.py explains the figures): 2e-5 over the first
# two steps, 1e-3 over three.
FP32 = (2e-5, 1e-3)


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _batch(kind: str, n: int = 4):
    data = W.dataset(kind, n)
    return (
        torch.stack([data[i][0] for i in range(n)]),
        torch.stack([data[i][1] for i in range(n)]),
    )


class _CountMatmuls(TorchDispatchMode):
    """Counts the matmuls that run (forward, recompute and backward)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _grads_and_backward_matmuls(kind: str, recompute: str, num_layers: int | None = None):
    model = W.make_model(kind)
    apply_ac(model, model.parallel_plan(), recompute, num_layers)
    x, y = _batch(kind)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    with _CountMatmuls() as counter:
        loss.backward()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()
    }
    return grads, counter.n


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_recompute_kinds_give_the_gradients_of_no_recompute_and_recompute_what_they_say(kind):
    """Recompute replays the same ops on the same inputs, so gradients are bitwise equal; what
    differs is how many forward matmuls the backward runs again. A block's forward has 6 matmuls
    (GPT: q, k, v, o, fc1, fc2) or 7 (Llama: + w3); the backward needs the outputs of all but
    the last (fc2 / w2), and non-reentrant checkpointing stops recomputing once it has them.
    So full recompute reruns 5 or 6 per block, op-level selective every second of those (k, o
    and for Llama w3), attention-core recompute none (SDPA is not a matmul op)."""
    ref, backward = _grads_and_backward_matmuls(kind, "none")
    needed = (6 if kind == "gpt" else 7) - 1
    expected_extra = {
        ("full", None): 4 * needed,  # 4 blocks
        ("full", 2): 2 * needed,  # the first two blocks only
        ("selective_op", None): 4 * (needed // 2),
        ("selective", None): 0,
    }
    for (recompute, layers), extra in expected_extra.items():
        grads, n = _grads_and_backward_matmuls(kind, recompute, layers)
        assert all(torch.equal(grads[k], ref[k]) for k in ref), (recompute, layers)
        assert n - backward == extra, (recompute, layers, n, backward)


def test_op_sac_policy_saves_matmuls_and_attention_except_every_second_matmul():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten

    class Ctx:
        is_recompute = False

    policy = op_sac_policy()
    ops = [
        aten.mm.default,
        aten.addmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.mm.default,
        aten.add.Tensor,
        aten.gelu.default,
    ]
    got = [policy(Ctx(), op) for op in ops]
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert got == [save, again, save, save, again, again]
    Ctx.is_recompute = True  # the recompute counts on its own and makes the same choices
    assert [policy(Ctx(), op) for op in ops] == got


def test_recompute_num_layers_checkpoints_the_first_n_blocks_of_each_pipeline_chunk():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model = W.make_model("gpt")  # 4 blocks: pp=2 gives chunks of 2
    plan = model.parallel_plan()
    strategy = Strategy.parse("pp=2,recompute=full,recompute_num_layers=1,global_batch_size=2")
    for rank in (0, 1):
        ((_, part),) = split_pipeline(model, plan, strategy, pp_rank=rank)
        apply_ac(part, plan, "full", 1)
        wrapped = {k: isinstance(b, CheckpointWrapper) for k, b in part.layers.items()}
        assert wrapped == {str(2 * rank): True, str(2 * rank + 1): False}


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_compile_matches_eager(kind):
    """Inductor fuses the elementwise work and may reorder fp32 reductions (norms, softmax):
    the FP32 tolerance of reordered arithmetic. Observed: under 2e-6."""
    ref = W.train_losses(B, kind)
    engine = Engine(
        lambda: W.make_model(kind),
        optimizer=lambda p: torch.optim.AdamW(p, lr=W.LR),
        strategy=f"{B},compile=true",
    )
    loader = engine.dataloader(W.dataset(kind), mode="train", steps_per_epoch=W.STEPS)
    got = [engine.run(batch)["loss"] for batch in loader]
    blocks = engine.model_parts_[0].layers.values()
    assert all(b._compiled_call_impl is not None for b in blocks)
    early = max(abs(a - b) for a, b in zip(got[:2], ref[:2]))
    gap = max(abs(a - b) for a, b in zip(got, ref))
    assert early <= FP32[0] and gap <= FP32[1], (got, ref)


# ---- fp8 ----------------------------------------------------------------------------------------
needs_torchao = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torchao") is None,
    reason="fp8 needs torchao (pip install 'autosearch[fp8]')",
)


def _cpu_scaled_mm_takes_row_scales() -> bool:
    """torch 2.13's CPU `_scaled_mm` takes row-wise scales; 2.11's only per-tensor ones (seen
    on the GPU check's machine: "only supports per-tensor scaling for CPU backend")."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_fp8_converts_the_block_linears_with_float8_rounding(kind, recipe):
    """Every block linear becomes a torchao Float8Linear; the embedding and the output stay.
    The logits then differ from fp32 by float8 rounding: e4m3 keeps 3 mantissa bits (relative
    rounding up to 2^-4 = 6.25% per operand, averaging down over a dot product), far above bf16
    (2^-9 = 0.2%). Observed: 2.0-3.4% relative (L2) for the real CPU kernel and for torchao's
    emulation alike; so 1% < error < 6.25%, and the two within 6.25% of each other."""
    from torchao.float8.float8_linear import Float8Linear

    if recipe == "rowwise" and not _cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only")
    x, _ = _batch(kind)
    ref = W.make_model(kind)(x)
    outs = {}
    for emulate in (False, True):
        model = W.make_model(kind)
        apply_fp8(model, model.parallel_plan(), recipe, emulate=emulate)
        converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        assert converted == {n for n in linears if n.startswith("layers.")}
        assert "output" in linears - converted
        assert type(model.tok_embeddings) is torch.nn.Embedding
        outs[emulate] = model(x)
        rel = float((outs[emulate] - ref).norm() / ref.norm())
        assert 0.01 < rel < 2**-4, (emulate, rel)
    assert float((outs[True] - outs[False]).norm() / ref.norm()) < 2**-4


@needs_torchao
def test_fp8_trains_under_the_engine_on_cpu():
    """torch._scaled_mm runs on this CPU, so the Engine runs fp8 here: the first loss is the
    forward with float8 rounding (observed within 5e-4 of fp32's 4.85, on logits 2-3% off), and
    the loss falls over three steps as in fp32 (observed 0.23)."""
    ref = W.train_losses(B, "gpt")
    for recipe in ("tensorwise", "rowwise"):
        got = W.train_losses(f"{B},fp8={recipe}", "gpt")
        assert abs(got[0] - ref[0]) < 5e-3 and got[-1] < got[0] - 0.1, (recipe, got, ref)


# ---- devices and refusals ----------------------------------------------------------------------
def test_torch_preset_declares_what_the_engine_runs_and_on_which_devices():
    torch_rt = RUNTIMES["torch"]
    assert set(torch_rt.supports) == {
        "cp",
        "fp8",
        "compile",
        "async_tp",
        "selective_op",
        "recompute_num_layers",
        "uneven_pp",
        "ep",  # autosearch/models/moe.py (parallel folding: over tp x cp x dp)
        "ep_over_tp",  # ep groups that take tp ranks (each tp rank routes its own tokens)
        "etp",  # the experts' width split over etp of the tp ranks
        "etp_below_tp",  # 1 < etp < tp: etp consecutive tp ranks (Megatron-Core's folding)
        "offload_optimizer",  # torchao's CPUOffloadOptimizer, or FSDP2's CPU offload with params
        "offload_params",  # FSDP2's CPUOffloadPolicy (tests/test_engine_offload.py)
        "offload_activations",  # save_on_cpu around each block
        "mamba",  # autosearch/models/ssm.py Mamba2Mixer (tests/test_engine_hybrid.py)
        "gdn",  # autosearch/models/ssm.py GatedDeltaNet
        "mamba_interleaved_pp",  # the Engine's pipeline splits any blocks (MambaModel cannot)
        "mamba_uneven_pp",
    }
    s = Strategy(tp=2, async_tp=True, compile=True, fp8="rowwise")
    assert torch_rt.unsupported(s) == {}
    assert torch_rt.cannot_run_on(s, "cpu") == {"async_tp": ("cuda",)}
    assert torch_rt.cannot_run_on(s, "cuda:8.0") == {"fp8": ("cpu", "cuda>=8.9")}
    assert torch_rt.cannot_run_on(s, "cuda:9.0") == {}
    assert device_meets("cuda:10.0", "cuda>=8.9") and not device_meets("cuda:8.6", "cuda>=8.9")
    assert not device_meets("cpu", "cuda")
    with pytest.raises(SpecError, match="devices must map features"):
        RuntimeOptions.from_dict({"devices": {"fp8": "cuda"}}, what="runtime 'x'")
    with pytest.raises(SpecError, match="'warp_drive'"):
        RuntimeOptions.from_dict({"devices": {"warp_drive": ["cuda"]}}, what="runtime 'x'")


def test_device_refusals_say_why_and_what_to_do():
    model = W.make_model("llama")
    plan = model.parallel_plan()
    s = Strategy.parse(f"tp=2,async_tp=true,compile=true,fp8=rowwise,{B}")
    (cpu,) = [p for p in strategy_problems(s, plan, model, device="cpu") if "async" in p]
    assert "async TP needs CUDA symmetric memory" in cpu and "set async_tp=false" in cpu
    old_gpu = strategy_problems(s, plan, model, device="cuda:8.0")
    assert any("fp8 cannot run on this device (cuda:8.0" in p and "fp8=none" in p for p in old_gpu)
    assert strategy_problems(s, plan, model, device="cuda:9.0") == []
    no_compile = Strategy.parse(f"tp=2,async_tp=true,{B}")
    assert any(
        "needs compile=true" in p
        for p in strategy_problems(no_compile, plan, model, device="cuda:9.0")
    )


def test_a_refused_strategy_changes_nothing_in_the_model():
    """async TP at tp=1 is refused (on a CPU: it needs CUDA symmetric memory; on a GPU: it
    needs tp > 1) before any other dimension (fp8, op-level recompute, compile) touches the
    model instance."""
    model = W.make_model("llama")
    before = {n: type(m) for n, m in model.named_modules()}
    engine = Engine(
        model,
        optimizer=torch.optim.AdamW(model.parameters()),
        strategy=f"{B},async_tp=true,compile=true,fp8=tensorwise,recompute=selective_op",
    )
    refusal = "needs CUDA symmetric memory" if not torch.cuda.is_available() else "needs tp > 1"
    with pytest.raises(SpecError, match=refusal):
        engine.prepare()
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(b._compiled_call_impl is None for b in model.layers.values())


def test_cp_needs_a_model_whose_attention_can_take_a_shard():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4)})

    problems = strategy_problems(
        Strategy.parse("cp=2,global_batch_size=2"), W.make_model("gpt").parallel_plan(), Plain()
    )
    assert any("cp=2 needs a model whose attention" in p for p in problems)


# ---- CUDA only ---------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@needs_torchao
def test_fp8_on_cuda_matches_the_emulation():
    """On sm89+ torch._scaled_mm runs float8 tensor cores; the logits stay within float8
    rounding of fp32 (as on CPU)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9+")
    x, _ = _batch("llama")
    ref = W.make_model("llama").cuda()(x.cuda())
    model = W.make_model("llama").cuda()
    apply_fp8(model, model.parallel_plan(), "rowwise")
    rel = float((model(x.cuda()) - ref).norm() / ref.norm())
    assert 0.01 < rel < 2**-4
