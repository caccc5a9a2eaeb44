"""Train a catalog GPT (shrunk to fit a CPU) with the autosearch Engine under any strategy.

    torchrun --nproc_per_node=2 examples/train_gpt.py --strategy examples/strategy.yaml
    python examples/train_gpt.py --strategy "micro_batch_size=4,global_batch_size=8,amp=fp32"

The strategy is a YAML file (as `autosearch tune` writes) or a "key=value,..." string; dp*tp*pp
must equal the number of processes. Rank 0 prints the progress; a strategy that cannot run
(wrong world size, tp not dividing the heads, ...) stops every rank with one message.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
)  # run from a checkout


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", required=True, help="strategy YAML path or 'dp=2,tp=1,...'")
    p.add_argument("--model", default="tiny-gpt", help="catalog model (default tiny-gpt)")
    p.add_argument("--layers", type=int, help="override n_layers (shrink a large catalog model)")
    p.add_argument("--hidden", type=int, help="override hidden_size")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-freq", type=int, default=5)
    p.add_argument("--save", help="save a checkpoint directory here at the end")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    import torch

    from autosearch import Engine, ModelSpec
    from autosearch.engine import Accuracy, SyntheticTokens
    from autosearch.models.transformer import Transformer

    spec = ModelSpec.load(args.model)
    changes = {k: v for k, v in (("n_layers", args.layers), ("hidden_size", args.hidden)) if v}
    spec = spec.scaled(**changes) if changes else spec
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        torch.set_num_threads(
            min(2, os.cpu_count() or 1)
        )  # torchrun sets 1 thread per process itself

    engine = Engine(
        lambda: Transformer(spec),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
        metrics=Accuracy(),
        strategy=args.strategy,
        seed=0,
    )
    engine.prepare(
        mode="train"
    )  # checks the strategy on every rank, builds and parallelizes the model
    strategy = engine.strategy_
    data = SyntheticTokens.for_model(spec, strategy.global_batch_size * args.steps, seed=0)
    valid = SyntheticTokens.for_model(spec, strategy.global_batch_size * 2, seed=1)
    if engine.mesh is None or engine.mesh.get_rank() == 0:
        print(
            f"{spec.name}: {spec.n_params:,} parameters; strategy {strategy.short()}; mesh"
            f" {engine.mesh}",
            flush=True,
        )
    engine.fit(
        data,
        epochs=args.epochs,
        steps_per_epoch=args.steps,
        valid_data=valid,
        log_freq=args.log_freq,
    )
    if args.save:
        engine.save(args.save)
    return 0


if __name__ == "__main__":
    from autosearch.engine import run_main

    run_main(main)
