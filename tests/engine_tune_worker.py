"""torchrun worker for tests/test_engine_tune.py: tune on this machine, then train with the result."""
import json
import sys

import torch

from autosearch import Engine, ModelSpec
from autosearch.engine import SyntheticTokens, run_main
from autosearch.engine import distributed as D
from autosearch.transformer import Transformer

SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=32)


def main():
    out, record = sys.argv[1], sys.argv[2]
    engine = Engine(lambda: Transformer(SPEC), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), seed=0)
    data = SyntheticTokens.for_model(SPEC, 64)
    engine.tune(data, batch_size=8, n_trials=20, seed=0, out=out, space={"amp": "fp32"}, verbose=0)
    history = engine.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    with open(f"{record}.{D.rank()}.json", "w") as f:
        json.dump({"strategy": engine.best_strategy_.to_dict(), "loss": history["loss"][-1]}, f)


run_main(main)
