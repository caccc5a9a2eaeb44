"""Launch scripts (bash) around an export: the multi-node rendezvous, placeholders that stop the
script with a message until they are set, and a mock-data switch for a smoke run.

Rendezvous: torchrun's c10d backend (`torchrun --rdzv-backend c10d --rdzv-endpoint
MASTER_ADDR:MASTER_PORT`, PyTorch elastic): every node runs the same script, torchrun gives each
process its rank. Under SLURM (run it on each node: ``srun --nodes N --ntasks-per-node 1 bash
megatron.sh``) the first node of the allocation is the endpoint; elsewhere MASTER_ADDR comes from
the environment (localhost on one node). Every value written is a number or a fixed word, and
the rest is quoted for the shell (`shell_words`), so no name becomes code.
"""

from __future__ import annotations

from autosearch.export._base import one_line, shell_words

# Placeholders: variable -> what to set it to. The message is fixed text (no $, quote or brace),
# printed by bash's ${VAR:?message} when the variable is unset or empty.
PLACEHOLDERS = {
    "DATA_PATH": "set DATA_PATH to your training data ({data}), or MOCK_DATA=1 for a smoke run",
    "TOKENIZER": "set TOKENIZER to your tokenizer ({tokenizer}), or MOCK_DATA=1 for a smoke run",
    "TRAIN_ITERS": "set TRAIN_ITERS to the optimizer steps to run, e.g. 10 for a smoke run",
    "LR": "set LR to the peak learning rate, e.g. 3e-4",
    "CHECKPOINT_DIR": "set CHECKPOINT_DIR to the folder that keeps the checkpoints",
}


def require(name: str, message: str) -> str:
    """A line that stops the script with `message` while `name` is unset or empty."""
    text = one_line(message)
    if any(c in text for c in '$`"}\\'):
        raise ValueError(f"placeholder message {text!r} holds a character the shell expands")
    return f': "${{{name}:?{text}}}"'


def script(
    *,
    title: str,
    nnodes: int,
    gpus_per_node: int,
    setup: list[str],
    program: list[str],
    args: list[str],
    tail: list[str],
    comments: list[str] = (),  # type: ignore[assignment]
    guard: str = "",
) -> str:
    """A bash launch script: `title` and `comments` as comment lines, `guard` (a refusal that
    stops the script), `setup` lines (placeholders, data), the rendezvous, then ``exec torchrun
    ... program args tail``: `program` and `tail` are shell text already, each of `args` a flag
    and its values, quoted here word by word."""
    lines = ["#!/usr/bin/env bash", f"# {one_line(title)}"]
    lines += [f"# {one_line(c)}" if c else "#" for c in comments]
    lines += ["set -euo pipefail", 'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"']
    if guard:
        lines += [
            'if [ "${ALLOW_UNSUPPORTED:-0}" != 1 ]; then',
            f"    echo {shell_words([one_line(guard)])} >&2",
            "    exit 2",
            "fi",
        ]
    lines += setup
    lines += [
        f"NNODES={nnodes}",
        f"GPUS_PER_NODE={gpus_per_node}",
        'if [ -n "${SLURM_JOB_NODELIST:-}" ]; then  # under srun: the first node is the endpoint',
        '    MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST"'
        ' | head -n 1)}"',
        "fi",
        'if [ "$NNODES" = 1 ]; then MASTER_ADDR="${MASTER_ADDR:-localhost}"; fi',
        require(
            "MASTER_ADDR",
            "set MASTER_ADDR to the address of the first node (the rendezvous endpoint), "
            "or run the script on each node with srun",
        ),
        'MASTER_PORT="${MASTER_PORT:-29500}"',
    ]
    command = [
        'exec torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"',
        '    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"',
        '    --rdzv-id "${SLURM_JOB_ID:-autosearch}"',
        "    " + " ".join(program),
    ]
    # one flag and its values per line: each word quoted for the shell
    command += ["    " + shell_words(group.split()) for group in args] + [f"    {t}" for t in tail]
    command = [line + " \\" for line in command[:-1]] + command[-1:]
    return "\n".join(lines + command) + "\n"
