"""Tune, train and save a Llama-style Hugging Face model with the autosearch Engine.

    python examples/finetune_hf.py --out runs/hf                       # one process
    torchrun --nproc_per_node=2 examples/finetune_hf.py --out runs/hf  # two
    python examples/finetune_hf.py --base path/to/hf_model --data train.bin --out runs/ft

1. The model: a transformers ``LlamaForCausalLM``, from ``--base`` (a folder written by
   ``save_pretrained``: fine-tuning) or a small random one built from a ``LlamaConfig``.
2. The data: a flat file of token ids (nanoGPT's ``train.bin``: ``np.array(ids,
   np.uint16).tofile(path)`` after tokenizing a corpus). Without ``--data`` the script writes one
   of synthetic text (a fixed random Markov chain over the vocabulary) so it runs offline.
3. ``Engine.tune`` searches the strategies for this machine (its calibrated profile) with the
   analytic cost model, runs the best ``--validate-top-k`` for real, and keeps the fastest.
4. ``Engine.fit`` trains with warm-up + cosine decay, gradient clipping, a checkpoint every
   ``--save-steps`` steps (rerun the same command to resume), metrics in ``<out>/metrics.csv``.
5. The result is saved twice: ``<out>/dcp`` (a DCP checkpoint, loadable under any strategy by
   ``Engine.load``) and ``<out>/hf`` (``AutoModelForCausalLM.from_pretrained`` loads it); the
   script loads the latter with transformers and checks that it predicts what the Engine does.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
)  # run from a checkout


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", required=True, help="folder of the study, checkpoints, metrics and saved models"
    )
    p.add_argument("--base", help="a save_pretrained folder of a Llama-style model to fine-tune")
    p.add_argument(
        "--data", help="token file (uint16 ids); default: write a synthetic one into --out"
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps of the learning rate")
    p.add_argument("--n-trials", type=int, default=40, help="trials of the strategy search")
    p.add_argument(
        "--validate-top-k",
        type=int,
        default=2,
        help="candidates run for real (0: trust the model)",
    )
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--log-freq", type=int, default=20)
    return p.parse_args()


def small_llama_config(seq_len: int):
    """A small Llama (4 layers, width 256, grouped-query attention): minutes on a CPU."""
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=512,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
    )


def write_synthetic_tokens(path: str, *, n_tokens: int, vocab_size: int) -> None:
    """A token file of synthetic text (autosearch's SyntheticTokens Markov chain), written once."""
    import numpy as np
    import torch

    from autosearch.engine import SyntheticTokens

    seq = 1024
    chain = SyntheticTokens(n_tokens // seq + 1, seq_len=seq - 1, vocab_size=vocab_size, seed=0)
    ids = torch.cat([torch.cat([chain[i][0][:1], chain[i][1]]) for i in range(len(chain))])[
        :n_tokens
    ]
    tmp = f"{path}.tmp{os.getpid()}"
    np.asarray(ids, dtype=np.uint16).tofile(tmp)
    os.replace(tmp, path)


def main() -> int:
    args = parse_args()
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from autosearch import Engine, ModelSpec
    from autosearch.engine import TokenFile, WarmupDecay
    from autosearch.engine import distributed as D

    world = D.launched_world_size()
    if world == 1:
        torch.set_num_threads(
            min(2, os.cpu_count() or 1)
        )  # torchrun sets 1 thread per process itself
    os.makedirs(args.out, exist_ok=True)
    config = (
        AutoModelForCausalLM.from_pretrained(args.base).config
        if args.base
        else small_llama_config(args.seq_len)
    )
    data_path = args.data or os.path.join(args.out, "train.bin")
    if not args.data and D.is_rank0() and not os.path.exists(data_path):
        write_synthetic_tokens(
            data_path,
            n_tokens=args.seq_len * args.batch_size * (args.steps + 8),
            vocab_size=config.vocab_size,
        )
    D.init_distributed()
    if dist.is_initialized():
        dist.barrier()  # the token file is written
    data = TokenFile(data_path, seq_len=args.seq_len, vocab_size=config.vocab_size)

    def build():
        if args.base:
            return LlamaForCausalLM.from_pretrained(args.base)
        return LlamaForCausalLM(config)

    spec = ModelSpec.from_hf_config(config, name="finetune-llama", seq_len=args.seq_len)
    engine = Engine(
        build,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1),
        model_spec=spec,
        seed=0,
        grad_clip_norm=1.0,
        lr_scheduler=WarmupDecay(
            warmup_steps=min(args.warmup, args.steps), total_steps=args.steps, min_lr_ratio=0.1
        ),
    )
    engine.tune(
        data,
        batch_size=args.batch_size,
        n_trials=args.n_trials,
        validate_top_k=args.validate_top_k,
        factory="autosearch.models.hf.causal_lm:llama_from_spec",
        steps=2,
        warmup=1,
        seed=0,
        out=os.path.join(args.out, "study"),
    )
    steps_per_epoch = len(data) // args.batch_size
    history = engine.fit(
        data,
        epochs=math.ceil(args.steps / steps_per_epoch),
        steps_per_epoch=min(steps_per_epoch, args.steps),
        save_dir=os.path.join(args.out, "ckpt"),
        save_steps=args.save_steps,
        save_freq=10**9,
        resume=True,
        log_dir=args.out,
        log_freq=args.log_freq,
    )
    engine.save(os.path.join(args.out, "dcp"))
    engine.save_pretrained(os.path.join(args.out, "hf"))

    # transformers loads what was saved, and predicts what the engine predicts (first global batch)
    sample = [data[i] for i in range(args.batch_size)]
    engine_loss = engine.evaluate(sample, batch_size=args.batch_size, verbose=0)["loss"]
    if D.is_rank0():
        hf = AutoModelForCausalLM.from_pretrained(os.path.join(args.out, "hf"))
        inputs, labels = torch.stack([x for x, _ in sample]), torch.stack([y for _, y in sample])
        with torch.no_grad():
            logits = hf(inputs).logits
        hf_loss = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))
        losses = history["loss"]
        if losses:  # empty when a rerun resumed from a finished run
            median_ms = sorted(history["step_time_s"])[len(losses) // 2] * 1e3
            print(
                f"trained to step {engine.global_step_} with {engine.strategy_.short()}: "
                f"loss {losses[0]:.3f} -> "
                f"{losses[-1]:.3f}, median step {median_ms:.0f} ms",
                flush=True,
            )
        print(
            f"transformers loads {os.path.join(args.out, 'hf')}: loss {hf_loss:.5f} "
            "on the first batch "
            f"(engine: {engine_loss:.5f})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    from autosearch.engine import run_main

    run_main(main)
