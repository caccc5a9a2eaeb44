"""The Engine's shape in one process: what its constructor stores, when its learned attributes
appear (scikit-learn's convention), inputs refused before anything runs, and no import cycle
among the engine's modules.

Multi-process behaviour is in test_engine_parallel.py and test_engine_loop.py; the table of bad
inputs in test_bad_inputs.py.
"""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from autosearch import Engine, ModelSpec, SpecError  # noqa: E402
from autosearch.engine import SyntheticTokens  # noqa: E402
from autosearch.models.transformer import Transformer  # noqa: E402

SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, hidden_size=64, vocab_size=128, seq_len=32)
B = "micro_batch_size=2,global_batch_size=4,amp=fp32"


@pytest.fixture(autouse=True)
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def factory():
    torch.manual_seed(0)
    return Transformer(SPEC)


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3)


def test_init_only_stores_its_arguments():
    engine = Engine(factory, optimizer=adamw, strategy=B, seed=3)
    assert set(vars(engine)) == set(inspect.signature(Engine).parameters)
    assert engine.mode is None and engine.history is None


def test_learned_attributes_exist_only_after_the_method_that_learns_them():
    engine = Engine(factory, optimizer=adamw, strategy=B, cluster="h100-sxm:1x1")
    learned = {
        "strategy_": "prepare",
        "model_parts_": "prepare",
        "optimizers_": "prepare",
        "global_step_": "prepare",
        "mesh_": "prepare",
        "history_": "fit",
        "cost_report_": "cost",
        "best_strategy_": "tune",
    }
    for name, method in learned.items():
        with pytest.raises(AttributeError, match=rf"Engine\.{name} .*call {method}\(\) first"):
            getattr(engine, name)
        assert not hasattr(engine, name)
    with pytest.raises(AttributeError, match="no attribute 'nonsense_'"):
        engine.nonsense_  # noqa: B018 - the access is the test

    engine.cost()  # learns the cost report, not the strategy (prepare and tune learn that)
    assert engine.cost_report_.step_time_s > 0 and not hasattr(engine, "strategy_")
    engine.prepare()
    assert engine.strategy_.global_batch_size == 4 and engine.global_step_ == 0
    assert len(engine.model_parts_) == len(engine.optimizers_) == 1 and engine.mesh_ is None
    assert not hasattr(engine, "history_") and engine.history is None
    history = engine.fit(SyntheticTokens.for_model(SPEC, 8), verbose=0)
    assert engine.history_ is history is engine.history and len(history["loss"]) == 2
    assert engine.global_step_ == 2  # two batches of 4 in 8 samples


def test_the_trainer_owns_the_state_it_changes():
    """fit, run, save and load change the step counter through the trainer only; the engine's
    learned attributes are views of it."""
    engine = Engine(factory, optimizer=adamw, strategy=B)
    data = SyntheticTokens.for_model(SPEC, 8)
    engine.fit(data, verbose=0)
    trainer = engine.trainer_
    assert engine.global_step_ == trainer.global_step == 2
    assert engine.model_parts_ is trainer.model_parts and engine.optimizers_ is trainer.optimizers
    engine.run(next(iter(engine.dataloader(data, mode="train"))))
    assert trainer.global_step == 3 and trainer.data_position == (1, 0)


def test_a_negative_clip_norm_is_refused_before_the_model_is_built():
    """grad_clip_norm=-1 scaled every gradient by a negative factor (gradient ascent: issue 22
    measured loss 6.96 -> 14.61 in 32 steps); now nothing is built and nothing trains."""
    built = []

    def counting_factory():
        built.append(1)
        return factory()

    engine = Engine(counting_factory, optimizer=adamw, strategy=B, grad_clip_norm=-1.0)
    with pytest.raises(SpecError, match=r"grad_clip_norm=-1.0: grad_clip_norm must be .*> 0"):
        engine.fit(SyntheticTokens.for_model(SPEC, 8), verbose=0)
    assert built == [] and not hasattr(engine, "trainer_")


def test_fit_refuses_options_that_train_nothing_before_anything_runs(tmp_path):
    engine = Engine(factory, optimizer=adamw, strategy=B)
    data = SyntheticTokens.for_model(SPEC, 8)
    with pytest.raises(SpecError, match="epochs=-1") as bad_epochs:
        engine.fit(data, epochs=-1, log_dir=str(tmp_path / "logs"), verbose=0)
    with pytest.raises(SpecError, match=r"batch_size=0: .*None for the strategy's"):
        engine.fit(data, batch_size=0, verbose=0)
    assert str(bad_epochs.value).startswith("fit: ")
    assert not hasattr(engine, "trainer_") and not (tmp_path / "logs").exists()


def test_engine_modules_import_each_other_without_a_cycle():
    """Not even through imports under TYPE_CHECKING or inside functions: the Engine builds a
    Trainer; the Trainer never reaches back to the Engine."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("autosearch", exclude_type_checking_imports=False)
    engine = {m for m in graph.modules if m.startswith("autosearch.engine.")}
    cycles = sorted(
        (a, b)
        for a in engine
        for b in graph.find_modules_directly_imported_by(a) & engine
        if b != a and graph.chain_exists(importer=b, imported=a)
    )
    assert cycles == []
