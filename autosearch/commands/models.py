"""`autosearch models`: the model catalog."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the model catalog")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autosearch.core.model_spec import model_catalog

    catalog = model_catalog()
    w = max(16, *map(len, catalog))  # the longest name sets the column
    print(
        f"{'name':<{w}} {'params':>9} {'active':>8} {'layers':>6} {'hidden':>6} {'heads':>5} "
        f"{'kv':>4} "
        f"{'ffn':>6} "
        f"{'act':>6} {'vocab':>7} {'seq':>5}"
    )
    # active: the parameters one token uses (differs from params for mixture-of-experts models)
    for name, m in catalog.items():
        print(
            f"{name:<{w}} {m.n_params / 1e9:8.2f}B {m.n_active_params / 1e9:7.2f}B "
            f"{m.n_layers:>6} {m.hidden_size:>6} "
            f"{m.n_heads:>5} {m.n_kv_heads:>4} {m.ffn_hidden_size:>6} {m.ffn_activation:>6} "
            f"{m.vocab_size:>7} {m.seq_len:>5}"
        )
    return 0
