"""The Engine in one process: API, data, optimizer rebuild, checkpoints, cost, tune, errors.

Multi-process behaviour (every strategy against this single-process run) is in
test_engine_parallel.py; the torchrun example in test_engine_example.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from autosearch import Engine, ModelSpec, SpecError, Strategy  # noqa: E402
from autosearch.engine import Accuracy, ParallelPlan, SyntheticTokens  # noqa: E402
from autosearch.engine.data import _DpShard, build_loader  # noqa: E402
from autosearch.models.transformer import Transformer  # noqa: E402

SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, hidden_size=64, vocab_size=128, seq_len=32)
B = "micro_batch_size=2,global_batch_size=8,amp=fp32"


def model_factory():
    torch.manual_seed(0)
    return Transformer(SPEC)


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3)


@pytest.fixture(autouse=True)
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_importing_the_engine_does_not_import_torch():
    code = (
        "import sys; import autosearch; from autosearch import Engine; from autosearch.engine"
        " import ParallelPlan; Engine(lambda: None); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_fit_evaluate_predict_single_process():
    engine = Engine(model_factory, optimizer=adamw, metrics=Accuracy(), strategy=B)
    history = engine.fit(
        SyntheticTokens.for_model(SPEC, 96),
        epochs=2,
        steps_per_epoch=6,
        valid_data=SyntheticTokens.for_model(SPEC, 16, seed=1),
        verbose=0,
    )
    assert engine.history is history
    assert (
        len(history["loss"]) == 12
        and len(history["epoch_loss"]) == 2
        and len(history["val_loss"]) == 2
    )
    assert history["loss"][-1] < history["loss"][0] - 0.2
    assert all(t > 0 for t in history["tokens_per_s"])
    logs = engine.evaluate(SyntheticTokens.for_model(SPEC, 16, seed=1), verbose=0)
    assert set(logs) == {"loss", "accuracy"} and logs["loss"] == pytest.approx(
        history["val_loss"][-1]
    )
    preds = engine.predict(SyntheticTokens.for_model(SPEC, 12, seed=1), batch_size=8)
    assert [p.shape[0] for p in preds] == [8, 4]  # predict keeps the last partial batch
    assert engine.mesh is None and engine.main_program is engine.model_parts_[0]


def test_gradient_accumulation_matches_one_big_batch():
    data = SyntheticTokens.for_model(SPEC, 16)
    losses = {}
    for mbs in (2, 8):
        engine = Engine(
            model_factory,
            optimizer=adamw,
            strategy=f"micro_batch_size={mbs},global_batch_size=8,amp=fp32",
        )
        losses[mbs] = engine.fit(data, epochs=1, verbose=0)["loss"]
    assert losses[2] == pytest.approx(losses[8], abs=2e-5)


def test_optimizer_is_rebuilt_with_its_class_and_param_groups():
    model = model_factory()
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=5e-4,
        betas=(0.9, 0.95),
    )
    engine = Engine(model, optimizer=opt, strategy=f"recompute=full,{B}").prepare(mode="train")
    (rebuilt,) = engine.optimizers_
    assert type(rebuilt) is torch.optim.AdamW and rebuilt is not opt
    groups = {g["weight_decay"]: len(g["params"]) for g in rebuilt.param_groups}
    assert groups == {0.1: len(decay), 0.0: len(no_decay)}
    assert all(g["lr"] == 5e-4 and g["betas"] == (0.9, 0.95) for g in rebuilt.param_groups)


class TinyClassifier(torch.nn.Module):
    """A user model with no plan: dp, zero, full recompute and amp still apply."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.body(x))


class Points(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, int(x[:3].argmax())


@pytest.mark.parametrize("strategy", ["recompute=full,amp=bf16", "amp=fp16", "amp=fp32"])
def test_user_model_without_plan(strategy):
    torch.manual_seed(0)
    model = TinyClassifier()
    engine = Engine(
        model,
        loss=torch.nn.functional.cross_entropy,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        metrics=Accuracy(),
        strategy=f"micro_batch_size=8,global_batch_size=16,{strategy}",
    )
    history = engine.fit(Points(), epochs=3, verbose=0)
    assert history["epoch_loss"][-1] < history["epoch_loss"][0]
    assert engine.evaluate(Points(), verbose=0)["accuracy"] > 0.5


def test_user_model_errors_say_what_to_pass():
    engine = Engine(TinyClassifier, strategy="recompute=selective,amp=fp32")
    with pytest.raises(SpecError, match=r"ParallelPlan\(attention_core"):
        engine.prepare()
    problems = engine._problems(
        Strategy(tp=2, pp=2, micro_batch_size=1, global_batch_size=2),
        ParallelPlan(),
        TinyClassifier(),
    )
    assert any("tensor-parallel plan" in p for p in problems)
    assert any("nn.ModuleDict" in p for p in problems)
    with pytest.raises(SpecError, match="model_spec="):
        Engine(TinyClassifier, cluster="h100-sxm:1x1", strategy="amp=bf16").cost()


def test_invalid_mode_and_training_without_optimizer():
    engine = Engine(model_factory, strategy=B)
    with pytest.raises(SpecError, match="mode must be one of"):
        engine.to_mode("training")
    with pytest.raises(SpecError, match="needs an optimizer"):
        engine.fit(SyntheticTokens.for_model(SPEC, 16), verbose=0)


def test_cost_uses_the_analytic_model():
    from autosearch import Cluster
    from cost_models import AnalyticCostModel

    strategy = Strategy(dp=8, micro_batch_size=1, global_batch_size=64, zero_stage=1)
    engine = Engine(
        lambda: Transformer(ModelSpec.load("gpt3-1.3b")), strategy=strategy, cluster="h100-sxm:1x8"
    )
    step_time_s, peak_memory_bytes = engine.cost()  # the factory is only built on the meta device
    report = AnalyticCostModel(
        ModelSpec.load("gpt3-1.3b"), Cluster.parse("h100-sxm:1x8")
    ).estimate(strategy)
    assert (step_time_s, peak_memory_bytes) == (report.step_time_s, report.peak_memory_bytes)
    with pytest.raises(SpecError, match="cluster"):
        Engine(model_factory, strategy=strategy).cost()


def test_tune_sets_the_best_strategy(tmp_path):
    engine = Engine(model_factory, cluster="h100-sxm:1x8")
    result = engine.tune(batch_size=16, n_trials=8, seed=0, out=str(tmp_path), verbose=0)
    assert engine.best_strategy_ == result.best_strategy == engine.strategy_
    assert engine.strategy is None  # the constructor argument is not overwritten (sklearn style)
    assert engine.best_strategy_.world_size == 8


def test_save_load_and_inference_file(tmp_path):
    data = SyntheticTokens.for_model(SPEC, 32)
    engine = Engine(model_factory, optimizer=adamw, strategy=B)
    engine.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    engine.save(str(tmp_path / "ckpt"))
    engine.save(str(tmp_path / "model.pt"), training=False)
    before = engine.evaluate(data, verbose=0)["loss"]
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(state) == sorted(Transformer(SPEC).state_dict())
    fresh = Engine(model_factory, optimizer=adamw, strategy=B)
    assert fresh.load(str(tmp_path / "ckpt")) == []
    assert fresh.evaluate(data, verbose=0)["loss"] == pytest.approx(before, abs=1e-6)
    other = Engine(model_factory, strategy=f"recompute=full,{B}")
    other.load(str(tmp_path / "model.pt"))
    assert other.evaluate(data, verbose=0)["loss"] == pytest.approx(before, abs=1e-6)
    with pytest.raises(SpecError, match="no checkpoint"):
        fresh.load(str(tmp_path / "missing"))


def test_loader_splits_each_global_batch_over_dp_ranks():
    data = SyntheticTokens.for_model(SPEC, 32)
    whole = [x for x, _ in build_loader(data, batch_size=8, dp=1, dp_rank=0)]
    halves = [[x for x, _ in build_loader(data, batch_size=8, dp=2, dp_rank=r)] for r in range(2)]
    for step, batch in enumerate(whole):
        union = torch.cat([halves[0][step], halves[1][step]])
        assert sorted(map(tuple, union.tolist())) == sorted(map(tuple, batch.tolist()))
    shards = [list(_DpShard(range(10), 2, r)) for r in range(2)]
    assert shards == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    with pytest.raises(SpecError, match="does not split over dp=2"):
        build_loader(data, batch_size=7, dp=2, dp_rank=0)


def test_synthetic_tokens_are_deterministic_and_learnable():
    a, b = SyntheticTokens.for_model(SPEC, 4), SyntheticTokens.for_model(SPEC, 4)
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(4))
    x, y = a[0]
    assert torch.equal(x[1:], y[:-1]) and x.shape == (SPEC.seq_len,)
    valid = SyntheticTokens.for_model(SPEC, 4, seed=1)
    assert torch.equal(valid.successor, a.successor) and not torch.equal(valid[0][0], a[0][0])


@pytest.mark.parametrize(
    "extra", ["cp=2", "fp8=tensorwise", "compile=true", "recompute=selective_op", "pp=1"]
)
def test_the_engine_runs_the_dimensions_of_todays_stacks_on_cpu(extra):
    """What the `torch` preset supports runs here; only a dimension this device cannot run is
    refused, with why and what to do (tests/test_engine_parity.py has the rest)."""
    from autosearch.core import Strategy
    from autosearch.core.runtime import engine_lacks

    assert engine_lacks(Strategy.parse(f"dp=2,{extra}"), "cpu") == []
    (problem,) = engine_lacks(Strategy.parse(f"dp=2,{extra},tp=2,async_tp=true"), "cpu")
    assert "async TP needs CUDA symmetric memory" in problem and "async_tp=false" in problem
    assert engine_lacks(Strategy.parse(f"dp=2,{extra},tp=2,async_tp=true"), "cuda:9.0") == []
