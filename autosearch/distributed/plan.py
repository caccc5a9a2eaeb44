"""ParallelPlan: what the Engine must know about a model to shard it (torch-free).

The reference transformer (`autosearch.models.transformer.Transformer.parallel_plan`) returns
one; a user
model returns its own from a ``parallel_plan()`` method or passes it as ``Engine(..., plan=...)``.
A model with no plan can still use dp, zero, full recompute (of the whole model) and amp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """Where a model's repeated blocks are, and how to split and shard it.

    Args:
        blocks: attribute (or dotted path, ``model.layers``) holding the repeated blocks, an
            ``nn.ModuleDict`` (keys "0", "1", ...) or ``nn.ModuleList``. Full recompute
            checkpoints each block, FSDP shards each block as one unit, and a pipeline stage
            keeps a contiguous run of them.
        first_stage: attributes (or dotted paths) only the first pipeline stage keeps
            (embeddings).
        last_stage: attributes (or dotted paths) only the last pipeline stage keeps (final
            norm, head). A stage sets the others to ``None``, so the model's ``forward`` must skip
            ``None``
            modules (as `autosearch.models.transformer.Transformer.forward` does, torchtitan
            style).
        split_points: block indices where pipeline chunks 1, 2, ... start (``pp * virtual_stages
            - 1`` of them, increasing); ``None`` splits the blocks evenly.
        tp_plan: ``tp_plan(*, sequence_parallel, loss_parallel) -> {module name pattern:
            ParallelStyle}`` for `torch.distributed.tensor.parallel.parallelize_module`;
            ``None`` means the model cannot use tp > 1.
        attention_core: path, inside a block, of the module that selective recompute
            checkpoints (Korthikanti et al. 2022); ``None`` means no selective recompute.
        check: ``check(strategy) -> [problem, ...]``: extra rules the model imposes (the
            reference transformer checks its ModelSpec: heads divisible by tp, and so on).
        compile_fullgraph: each block compiles to one graph (``torch.compile(fullgraph=True)``,
            as torchtitan); False lets Dynamo break graphs (code it cannot trace).
    """

    blocks: str = "layers"
    first_stage: tuple[str, ...] = ()
    last_stage: tuple[str, ...] = ()
    split_points: tuple[int, ...] | None = None
    tp_plan: Callable[..., dict[str, Any]] | None = None
    attention_core: str | None = None
    check: Callable[[Any], list[str]] | None = None
    compile_fullgraph: bool = True

    def chunk_bounds(self, n_blocks: int, n_chunks: int) -> list[tuple[int, int]] | str:
        """(start, stop) block ranges of each pipeline chunk, or a message saying why not."""
        if self.split_points is None:
            if n_blocks % n_chunks:
                return (
                    f"{n_blocks} blocks do not split into pp*virtual_stages = {n_chunks} equal"
                    f" chunks; use pp*virtual_stages dividing {n_blocks}, or pass"
                    " ParallelPlan(split_points=...)"
                )
            size = n_blocks // n_chunks
            return [(i * size, (i + 1) * size) for i in range(n_chunks)]
        points = list(self.split_points)
        if len(points) != n_chunks - 1:
            return (
                f"split_points {points} make {len(points) + 1} pipeline chunks but the strategy"
                f" needs pp*virtual_stages = {n_chunks}; give {n_chunks - 1} split points"
            )
        edges = [0, *points, n_blocks]
        if any(b <= a for a, b in zip(edges, edges[1:])):
            return (
                f"split_points {points} must be increasing block indices between 1 and"
                f" {n_blocks - 1} (every chunk needs at least one block)"
            )
        return list(zip(edges, edges[1:]))


def get_path(module: Any, path: str) -> Any:
    """The attribute at a dotted path (``model.layers``), or None where any step is missing."""
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def set_path(module: Any, path: str, value: Any) -> None:
    """Set the attribute at a dotted path of a module (the parent must exist)."""
    parent, _, leaf = path.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, value)
