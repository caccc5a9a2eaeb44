"""The Engine's own runtime (`torch`) plans hybrids (issue 33): its plain-PyTorch scans priced op
by op (`MambaSpec.torch_scan`, `GatedDeltaNetSpec.torch_scan`, runtime ``ssm_scan:
torch_chunked``), checked against a census of the aten ops autograd runs for the Engine's own
scans on CPU (autosearch/models/ssm.py ``ssd_scan``, ``chunk_gated_delta_rule``); `autosearch
tune` under the default runtime and `Engine.tune` on a hybrid, end to end.

The census (a ``TorchDispatchMode``) counts, forward and backward, every op that is not a view:
its launches, the elements of its inputs and outputs, and the FLOPs of its bmm's; and, with
``saved_tensors_hooks``, each storage autograd saves once. Tolerances, from the shapes below
(docs/runtimes.md [1.9]): bmm FLOPs exact (the lists name every bmm; the census does not count
the triangular solve, which the GDN list does); elements within 12% (the masks, scalars and
broadcast operands the lists leave out: 2-10% here); saved within 12% (the per-head scalars:
0-11%); launches within 30% (autograd's own small ops in backward: 21-28% more than the lists).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autosearch import Cluster, ModelSpec, Strategy
from autosearch.core._ssm import GatedDeltaNetSpec, MambaSpec
from autosearch.core.runtime import RUNTIMES
from cost_models import AnalyticCostModel

ROOT = Path(__file__).resolve().parent.parent
# (batch, seq, heads, head_dim or head_k_dim, d_state or head_v_dim, groups, chunk): 4, 16 and
# 12 chunks per sequence (the GDN loop's backward grows with them)
SHAPES = [(1, 128, 4, 8, 16, 2, 32), (1, 512, 4, 8, 16, 2, 32), (2, 96, 8, 8, 8, 2, 8)]
# a catalog hybrid with Mamba-2 layers
NEMOTRON = "nemotron-h-8b"
# the whole mixer's saved bytes under bf16 autocast (test_what_the_engines_mixer_saves_...):
# the model counts the scan's saved tensors as the fp32 census above sees them (within 12%)
# and, for the rest of the mixer, what the fused path keeps (in_proj's output, the scan's
# output, out_proj's input). Two errors of opposite sign remain, both left for later: under
# autocast a bmm saves 16-bit casts of its operands where the fp32 run saves fp32 copies (the
# scan's count is about a third high on a Mamba mixer of d_inner 256), and the eager mixer
# keeps fp32 tensors around the scan that the fused path does not (Mamba: the D skip's x, the
# gated norm's input, z, silu(z) and their products, about 24 bytes per channel of d_inner;
# GDN: q and k in its l2norm, the head norm's input, z and silu(z)). Found: the model 6% under
# the census for Mamba, 20% under for GDN (4,609 / 3,609 bytes a token on these shapes).
MIXER_SAVED_REL = {"mamba": 0.10, "gdn": 0.25}


def _census(kind: str, shape: tuple[int, ...]) -> dict[str, float]:
    """Per token: forward / backward launches, elements, bmm FLOPs; bytes saved."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from autosearch.models.ssm import chunk_gated_delta_rule, ssd_scan

    views = {
        "view", "unsqueeze", "permute", "expand", "_unsafe_view", "slice", "select", "detach",
        "alias", "t", "transpose", "squeeze", "split", "unbind", "as_strided", "promote_types",
        "split_with_sizes", "reshape", "_reshape_alias",
    }  # fmt: skip

    class Census(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.launches, self.elements, self.flops = 0, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if name in views:
                return out
            ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
            self.launches += 1
            self.elements += sum(a.numel() for a in ins + outs)
            if name == "bmm":
                (g, m, k), n = ins[0].shape, ins[1].shape[2]
                self.flops += 2 * g * m * k * n
            return out

    b, s, h, p, n, g, q = shape
    torch.manual_seed(0)
    if kind == "mamba":
        args = (
            torch.randn(b, s, h, p), torch.rand(b, s, h), -torch.rand(h),
            torch.randn(b, s, g, n), torch.randn(b, s, g, n),
        )  # fmt: skip
        fn = ssd_scan
    else:
        args = (
            torch.randn(b, s, h, p), torch.randn(b, s, h, p), torch.randn(b, s, h, n),
            -torch.rand(b, s, h), torch.rand(b, s, h),
        )  # fmt: skip
        fn = chunk_gated_delta_rule
    for a in args:
        a.requires_grad_(True)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    fwd, bwd = Census(), Census()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fwd:
        y = fn(*args, chunk_size=q)
    with bwd:
        y.backward(torch.ones_like(y))
    tokens = b * s
    return {
        "fwd_launches": fwd.launches,
        "bwd_launches": bwd.launches,
        "fwd_elements": fwd.elements / tokens,
        "bwd_elements": bwd.elements / tokens,
        "fwd_flops": fwd.flops / tokens,
        "bwd_flops": bwd.flops / tokens,
        "saved_bytes": sum(storages.values()) / tokens,
    }


def _listed(kind: str, shape: tuple[int, ...]):
    b, s, h, p, n, g, q = shape
    if kind == "mamba":
        spec = MambaSpec(n_heads=h, head_dim=p, d_state=n, n_groups=g, chunk_size=q)
    else:
        spec = GatedDeltaNetSpec(
            n_k_heads=h, n_v_heads=h, head_k_dim=p, head_v_dim=n, chunk_size=q
        )
    return spec.torch_scan(seq_len=s)


@pytest.mark.parametrize("kind", ["mamba", "gdn"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"seq{s[1]}_chunk{s[6]}")
def test_the_listed_ops_are_what_autograd_runs(kind, shape):
    census, scan = _census(kind, shape), _listed(kind, shape)

    def total(ops, field, *, skip=()):
        return sum(getattr(op, field) for op in ops if op.name not in skip)

    solve = ("solve_triangular", "solve_triangular grad 1", "solve_triangular grad 2")
    assert total(scan.forward, "flops_per_token", skip=solve) == census["fwd_flops"]
    assert total(scan.backward, "flops_per_token", skip=solve) <= census["bwd_flops"]
    if kind == "mamba":  # every backward matmul is a bmm of a forward einsum
        assert total(scan.backward, "flops_per_token") == census["bwd_flops"]
    for phase in ("fwd", "bwd"):
        ops = scan.forward if phase == "fwd" else scan.backward
        listed = total(ops, "elements_per_token")
        assert listed == pytest.approx(census[f"{phase}_elements"], rel=0.12), phase
        assert total(ops, "launches") == pytest.approx(census[f"{phase}_launches"], rel=0.30)
    assert 4 * scan.saved_elements_per_token == pytest.approx(census["saved_bytes"], rel=0.12)


# ---- the cost model under the torch runtime ----------------------------------------------------
def _model() -> ModelSpec:
    return ModelSpec.load(NEMOTRON)


def test_the_torch_runtime_prices_its_scans_slower_and_bigger_than_the_fused_kernels():
    """Same strategy, same runtime but for `ssm_scan`: the plain-PyTorch scans take longer and
    save more (the chunk decays and products in fp32) than mamba_ssm's kernels; a model without
    Mamba or GDN layers prices the same under both (tools/fingerprint.py holds them bit for
    bit)."""
    cluster = Cluster.parse("h100-sxm:1x8")
    s = Strategy.parse("dp=2,tp=4,sequence_parallel=true,micro_batch_size=1,global_batch_size=64")
    eager = RUNTIMES["torch"]
    assert eager.ssm_scan == "torch_chunked" and {"mamba", "gdn"} <= set(eager.supports)
    fused = dataclasses.replace(eager, ssm_scan="fused")
    torch_report = AnalyticCostModel(_model(), cluster, runtime=eager).estimate(s)
    fused_report = AnalyticCostModel(_model(), cluster, runtime=fused).estimate(s)
    assert torch_report.step_time_s > fused_report.step_time_s
    assert torch_report.memory.activations_bytes > fused_report.memory.activations_bytes
    dense = ModelSpec.load("llama3-8b")
    a = AnalyticCostModel(dense, cluster, runtime=eager).estimate(s)
    b = AnalyticCostModel(dense, cluster, runtime=fused).estimate(s)
    assert a.step_time_s == b.step_time_s


def test_an_unknown_scan_is_refused_with_the_choices():
    from autosearch import SpecError
    from autosearch.core.runtime import RuntimeOptions

    with pytest.raises(SpecError, match="ssm_scan must be one of fused, torch_chunked, got 'x'"):
        RuntimeOptions.from_dict({"name": "r", "ssm_scan": "x"}, what="runtime r")


def test_the_engine_refuses_cp_over_mamba_and_the_planner_does_not_offer_it():
    """`mamba_cp` stays off the torch preset: a cp strategy on a Mamba hybrid is not the
    Engine's to run (models/ssm.py ssm_strategy_problems)."""
    assert "mamba_cp" not in RUNTIMES["torch"].supports
    s = Strategy.parse("dp=4,cp=2,micro_batch_size=1,global_batch_size=64")
    assert "mamba_cp" in RUNTIMES["torch"].unsupported(s, _model())


def test_autosearch_tune_plans_a_hybrid_under_the_default_runtime_without_torch(tmp_path):
    """`autosearch tune --model nemotron-h-8b` (runtime torch, the default) prints a pick and
    writes its files, in a process that never imports torch."""
    out = tmp_path / "tune"
    code = (
        "import sys\n"
        "from autosearch.cli import main\n"
        f"rc = main(['tune', '--model', '{NEMOTRON}', '--cluster', 'h100-sxm:1x8',\n"
        "    '--global-batch-size', '64', '--n-trials', '40', '--seed', '0',\n"
        f"    '--out', {str(out)!r}])\n"
        "assert 'torch' not in sys.modules, 'the planner imported torch'\n"
        "sys.exit(rc)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "best " in run.stdout and "tokens/s" in run.stdout
    assert "this plan is for torch" in run.stdout
    best = yaml.safe_load((out / "best_strategy.yaml").read_text())
    strategy = Strategy.from_yaml(str(out / "best_strategy.yaml"))
    assert best["strategy"]["cp"] == 1
    assert strategy.cp == 1  # no Mamba context parallel for the Engine
    for name in ("trials.csv", "top_k.csv", "report.md"):
        assert (out / name).stat().st_size > 0


# ---- Engine.tune on a hybrid, on this CPU ------------------------------------------------------
CPU_PROFILE = ROOT / "results" / "calibration" / "example-amd-epyc-2c-np1.yaml"


def test_engine_tune_picks_a_strategy_for_a_mamba_hybrid_and_trains_it(tmp_path):
    """`Engine.tune` on a tiny Mamba-2 / attention hybrid (tests/engine_workers.py
    ``mamba_hybrid``), priced on the committed CPU profile: the pick is one the Engine's mixers
    accept (`ssm_strategy_problems`: no cp), `Engine.cost` prices it, and it trains."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).parent))
    import engine_workers as W

    from autosearch import Engine
    from autosearch.engine import SyntheticTokens
    from autosearch.models.ssm import ssm_strategy_problems
    from autosearch.models.transformer import Transformer

    spec = W.MODELS["mamba_hybrid"]
    engine = Engine(
        lambda: Transformer(spec),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        seed=0,
    )
    data = SyntheticTokens.for_model(spec, 16)
    result = engine.tune(
        data,
        batch_size=8,
        cluster=f"{CPU_PROFILE}:1x1",
        n_trials=10,
        seed=0,
        out=str(tmp_path),
        space={"amp": "fp32"},
        verbose=0,
    )
    best = engine.best_strategy_
    assert best == result.best_strategy and best.world_size == 1 and best.cp == 1
    assert not ssm_strategy_problems(spec, best)
    assert result.best_report.step_time_s > 0 and result.best_report.fits
    engine.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    assert engine.strategy_ == best


# ---- the whole mixer's saved activations under autocast ----------------------------------------
@pytest.mark.parametrize("kind", ["mamba", "gdn"])
def test_what_the_engines_mixer_saves_is_what_the_torch_runtime_counts(kind):
    """One Mamba-2 / Gated DeltaNet mixer of the Engine under bf16 autocast (as the Engine
    trains with amp bf16): the storages autograd saves, per token (the difference between two
    micro-batch sizes, as tests/test_saved_activations.py), against the cost model's saved
    bytes of that sublayer under the `torch` runtime, less what any sublayer keeps (its norm's
    and first linear's input). Tolerance `MIXER_SAVED_REL`."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).parent))
    import engine_workers as W

    from autosearch.models.ssm import GatedDeltaNet, Mamba2Mixer
    from cost_models.terms import ssm

    spec = W.MODELS["mamba_hybrid" if kind == "mamba" else "gdn_dense"].scaled(seq_len=128)
    torch.manual_seed(0)
    if kind == "mamba":
        mixer = Mamba2Mixer(spec.mamba, spec.hidden_size)
    else:
        mixer = GatedDeltaNet(spec.gdn, spec.hidden_size)

    def saved(mb: int) -> int:
        x = torch.randn(mb, spec.seq_len, spec.hidden_size, requires_grad=True)
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                mixer(x)
        return sum(storages.values())

    census = (saved(4) - saved(2)) / (2 * spec.seq_len)
    cm = AnalyticCostModel(spec, Cluster.parse(f"{CPU_PROFILE}:1x1"), runtime="torch")
    s = Strategy.parse("dp=1,micro_batch_size=1,global_batch_size=1,amp=bf16")
    sub = (ssm._mamba if kind == "mamba" else ssm._gdn)(s, cm._context)
    model = (sub.activation_bytes - ssm._sublayer_input_bytes(s, cm._context)) / spec.seq_len
    print(f"{kind}: census {census:.0f} B/token, model {model:.0f} B/token")
    assert model == pytest.approx(census, rel=MIXER_SAVED_REL[kind])
