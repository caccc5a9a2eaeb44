"""torchrun worker for tests/test_engine_tune.py.

``same``: tune on this machine, then train with the result; every rank records its strategy.
``slow``: rank 0's search takes longer than the others' wait_timeout_s: they must give up with a
TimeoutError that says why, instead of hanging.
"""

import json
import os
import sys
import time

import torch

from autosearch import Engine, ModelSpec, autotune
from autosearch.engine import SyntheticTokens, run_main
from autosearch.engine import distributed as D
from autosearch.models.transformer import Transformer

SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=32)


def main():
    mode, out, record = sys.argv[1], sys.argv[2], sys.argv[3]
    engine = Engine(
        lambda: Transformer(SPEC), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), seed=0
    )
    data = SyntheticTokens.for_model(SPEC, 64)
    if mode == "slow":
        if D.rank() == 0:
            autotune._search = lambda **_: (time.sleep(15), os._exit(0))
        try:
            engine.tune(data, batch_size=8, out=out, wait_timeout_s=3, verbose=0)
        except TimeoutError as exc:
            with open(f"{record}.{D.rank()}.json", "w") as f:
                json.dump({"error": str(exc)}, f)
            sys.stdout.flush()
            os._exit(0)
        return
    engine.tune(data, batch_size=8, n_trials=20, seed=0, out=out, space={"amp": "fp32"}, verbose=0)
    history = engine.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    with open(f"{record}.{D.rank()}.json", "w") as f:
        json.dump({"strategy": engine.strategy_.to_dict(), "loss": history["loss"][-1]}, f)


run_main(main)
