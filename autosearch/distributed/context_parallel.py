"""Context parallelism: the sequence of every sample split over the cp ranks.

Load-balanced causal sharding (torch's head-tail load balancer, Megatron-LM's context parallel):
the sequence is cut into 2 * cp chunks and cp rank i holds chunks i and 2cp-1-i, so each rank has
the same causal attention work. The Engine's data loader gives each rank its chunks of the inputs
and labels (`shard_sequence`); a model reads the global positions of its tokens (rotary and
learned position embeddings) from `ContextParallel.positions`; its attention core sees this
rank's queries against the keys and values of the whole sequence (`ContextParallel.attention`).

Two attention paths:

* CUDA: torch's ring attention (SDPA on DTensors sharded on the sequence, with its context
  parallel dispatcher, as torchtitan 0.3 applies it). Not run on this project's CPU machines.
* CPU: torch's has no sharding rule for the CPU SDPA kernel ("Operator
  aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
  registered", torch 2.13 with gloo), so the Engine runs an exact attention of its own:
  all-gather K and V over the cp group (autograd: the backward all-reduces their gradients and
  keeps this rank's part), then SDPA under the causal mask of the global positions. The math is
  that of one process; only the order of the fp32 sums differs.

Each cp rank computes the loss of its own tokens; as the ranks hold equal token counts, the
gradient averaged over dp x cp (the Engine's data-parallel group) is the full batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh


def chunk_order(cp: int) -> list[int]:
    """The global chunks in the order the cp ranks hold them: 0, 2cp-1, 1, 2cp-2, ..."""
    return [c for rank in range(cp) for c in (rank, 2 * cp - 1 - rank)]


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, *, dim: int = 1) -> torch.Tensor:
    """This cp rank's chunks (i and 2cp-1-i of 2 cp) of a batch's sequence dimension."""
    length = tensor.shape[dim]
    if length % (2 * cp):
        raise SpecError(
            f"cp={cp} splits each sequence into 2*cp = {2 * cp} equal chunks (load-balanced "
            f"causal sharding); sequences of {length} tokens do not split so: use a sequence "
            f"length divisible by {2 * cp}"
        )
    chunks = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather a tensor along `dim` over a group (rank order); the gradient of this rank's
    part is the sum over the ranks of the gradients they computed for it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        size = dist.get_world_size(ctx.group)
        mine = grad.chunk(size, dim=ctx.dim)[dist.get_rank(ctx.group)]
        return mine.contiguous(), None, None


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """The cp group of this rank and how it holds the sequence.

    Attributes:
        cp: the context-parallel degree.
        rank: this rank's index in the cp group.
        mesh: the 1-D cp DeviceMesh.
    """

    cp: int
    rank: int
    mesh: "DeviceMesh"

    @classmethod
    def of(cls, mesh: "DeviceMesh") -> "ContextParallel":
        return cls(cp=mesh.size(), rank=mesh.get_local_rank(), mesh=mesh)

    def positions(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        """Global positions of this rank's `local_len` tokens (its two chunks)."""
        return self._positions(self.rank, local_len, device)

    def _positions(self, rank: int, local_len: int, device) -> torch.Tensor:
        chunk = local_len // 2
        first, second = rank * chunk, (2 * self.cp - 1 - rank) * chunk
        return torch.cat(
            [
                torch.arange(first, first + chunk, device=device),
                torch.arange(second, second + chunk, device=device),
            ]
        )

    def gather_sequence(self, tensor: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
        """The whole sequence, in order, from every cp rank's chunks (no gradient: outputs)."""
        parts = [torch.empty_like(tensor) for _ in range(self.cp)]
        dist.all_gather(parts, tensor.contiguous(), group=self.mesh.get_group())
        chunks: list[torch.Tensor | None] = [None] * (2 * self.cp)
        for rank, part in enumerate(parts):
            chunks[rank], chunks[2 * self.cp - 1 - rank] = part.chunk(2, dim=dim)
        return torch.cat([c for c in chunks if c is not None], dim=dim)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        dropout_p: float = 0.0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Causal softmax(QK^T) V of this rank's queries over the whole sequence; q, k, v are
        (batch, heads, local sequence, head_dim) (k and v may have fewer heads: GQA)."""
        if q.device.type == "cuda":
            return self._ring_attention(q, k, v, dropout_p=dropout_p, scale=scale)
        group = self.mesh.get_group()
        k_all = _GatherSequence.apply(k, group, 2)
        v_all = _GatherSequence.apply(v, group, 2)
        local = q.shape[2]
        q_pos = self.positions(local, q.device)
        k_pos = torch.cat([self._positions(r, local, q.device) for r in range(self.cp)])
        mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # True: attend (key not after query)
        return F.scaled_dot_product_attention(
            q,
            k_all,
            v_all,
            attn_mask=mask,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def whole_keys_values(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys and values of the whole sequence, all-gathered over the cp group (the
        backward sums their gradients and keeps this rank's part), and the global position of
        each gathered key; k and v are (batch, heads, local sequence, head_dim). For attention
        kernels the ring cannot run (sliding windows, logit soft-capping): the caller masks by
        the global positions of its queries (`positions`) and keys, exactly as one process."""
        group = self.mesh.get_group()
        local = k.shape[2]
        key_positions = torch.cat([self._positions(r, local, k.device) for r in range(self.cp)])
        return (
            _GatherSequence.apply(k, group, 2),
            _GatherSequence.apply(v, group, 2),
            key_positions,
        )

    def _ring_attention(self, q, k, v, *, dropout_p: float, scale: float | None) -> torch.Tensor:
        """torch's ring attention (CUDA): SDPA on DTensors sharded on the sequence, with the
        head-tail load balancing the data loader's sharding matches (torchtitan 0.3's
        ``apply_cp_to_forward``). Keys and values are expanded to the query heads first, as
        torchtitan does (``repeat_kv``)."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.experimental._attention import (
            _enable_context_parallel_dispatcher,
        )

        _enable_context_parallel_dispatcher()
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        q, k, v = (
            DTensor.from_local(t.contiguous(), self.mesh, [Shard(2)], run_check=False)
            for t in (q, k, v)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale
        )
        return out.to_local() if isinstance(out, DTensor) else out
