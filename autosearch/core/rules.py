"""The rules a parallel layout must follow, each written once.

Every rule is a small function that returns ``None`` when the layout follows it, else one message
that says what is wrong and how to fix it. `Strategy.problems` composes all of them;
`search_spaces.SearchSpace` builds its tree with the same functions, so the space holds exactly
the strategies that `Strategy.validate` accepts (tests/test_search_spaces.py compares
`enumerate()` with a brute-force grid filtered by validation).

Sources: tensor parallel splits heads (Shoeybi et al. 2019, sec. 3); a pipeline needs at least
one micro-batch per stage to fill, and interleaved 1F1B needs pp * v to divide the layers and the
micro-batch count to be a multiple of pp (Narayanan et al. 2021, sec. 2.2); sequence parallel
splits the sequence over the tp group (Korthikanti et al. 2022, sec. 4.2.2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec

INTERLEAVED = "interleaved_1f1b"


def world_size_problem(dp: int, tp: int, pp: int, *, devices: int, where: str = "") -> str | None:
    if dp * tp * pp == devices:
        return None
    return (
        f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} but the cluster has {devices} devices{where};"
        f" choose degrees whose product is {devices}"
    )


def tp_problem(tp: int, model: ModelSpec) -> str | None:
    """tp splits the attention heads and the key/value heads."""
    if model.n_heads % tp:
        return (
            f"tp={tp} does not divide n_heads={model.n_heads}; use a tp that divides"
            f" {model.n_heads}"
        )
    if model.n_kv_heads % tp:
        return (
            f"tp={tp} does not divide n_kv_heads={model.n_kv_heads}; "
            f"use a tp that divides {model.n_kv_heads}"
        )
    return None


def layers_problem(pp: int, virtual_stages: int, model: ModelSpec) -> str | None:
    """The layers split into pp * virtual_stages equal chunks."""
    chunks = pp * virtual_stages
    if model.n_layers % chunks == 0:
        return None
    return (
        f"n_layers={model.n_layers} does not split into pp*virtual_stages = {pp}*{virtual_stages}"
        f" = {chunks} equal chunks; use pp*virtual_stages dividing {model.n_layers}"
    )


def batch_problem(global_batch_size: int, dp: int, micro_batch_size: int) -> str | None:
    """The global batch splits into dp ranks x whole micro-batches."""
    per_step = dp * micro_batch_size
    if global_batch_size % per_step == 0:
        return None
    return (
        f"global_batch_size={global_batch_size} does not split into dp*micro_batch_size ="
        f" {dp}*{micro_batch_size} = {per_step}; use a global batch that is a multiple of"
        f" {per_step}"
    )


def sequence_parallel_problem(sequence_parallel: bool, tp: int, seq_len: int | None) -> str | None:
    """Sequence parallel shards activations over tp > 1 ranks along the sequence."""
    if not sequence_parallel:
        return None
    if tp == 1:
        return (
            "sequence_parallel needs tp > 1 (it shards activations over the tp group); "
            "set tp > 1 or turn it off"
        )
    if seq_len is not None and seq_len % tp:
        return f"sequence_parallel with tp={tp} needs seq_len={seq_len} divisible by tp"
    return None


def schedule_problem(schedule: str, pp: int, virtual_stages: int) -> str | None:
    """Virtual stages exist only in the interleaved schedule, which needs a pipeline."""
    if virtual_stages > 1 and schedule != INTERLEAVED:
        return (
            f"virtual_stages={virtual_stages} needs pipeline_schedule interleaved_1f1b (got "
            f"{schedule}); set virtual_stages=1 or the interleaved schedule"
        )
    if schedule == INTERLEAVED and pp == 1:
        return "interleaved_1f1b needs pp > 1; use pipeline_schedule=1f1b with pp=1"
    if schedule == INTERLEAVED and virtual_stages == 1:
        return (
            "interleaved_1f1b needs virtual_stages > 1 (model chunks per pipeline rank); "
            "set virtual_stages or use 1f1b"
        )
    return None


def microbatch_problem(pp: int, n_microbatches: int, schedule: str) -> str | None:
    """A pipeline of pp stages needs >= pp micro-batches; interleaving a multiple of pp."""
    if pp == 1:
        return None
    if n_microbatches < pp:
        return (
            f"pipeline with pp={pp} needs at least {pp} micro-batches per step, got "
            f"{n_microbatches} (= global_batch_size / (dp*micro_batch_size)); raise the global "
            "batch or lower micro_batch_size"
        )
    if schedule == INTERLEAVED and n_microbatches % pp:
        return (
            f"interleaved_1f1b needs the micro-batch count {n_microbatches} to be a multiple of"
            f" pp={pp}"
        )
    return None
