"""Mixture-of-experts layer and expert parallelism (the Engine's ``ep``).

`MoE` is the expert MLP of a block (Shazeer et al. 2017; Mixtral, Jiang et al. 2024): a router
scores the experts of each token (softmax, or sigmoid as DeepSeek-V3), keeps the top k, and the
token's output is the weighted sum of those routed SwiGLU experts, plus the shared experts every
token goes through (DeepSeek-MoE, Dai et al. 2024). Routing is dropless (every routed copy is
computed, Megatron-Core's default): the copies are sorted by expert and the local experts run
as grouped GEMMs over their contiguous rows (`grouped_mm`: ``torch._grouped_mm``, one kernel for
all experts as torchtitan and Megatron-Core's ``--moe-grouped-gemm`` run them, and a loop of
matmuls where that kernel does not take the dtype or the device).
The experts are stored stacked, ``w1, w3: [E, d, f]`` and ``w2: [E, f, d]``, so that expert
parallelism shards them on the expert dimension.

The load-balancing loss (Switch Transformer, Fedus et al. 2022, eq. 4, for top-k as
Megatron-Core's ``switch_load_balancing_loss_func``) is ``E * sum_i f_i * P_i`` with ``f_i`` the
fraction of routed copies sent to expert ``i`` (summing to 1) and ``P_i`` the mean router
probability of ``i``; it is 1 for a perfectly balanced router. It is computed per sequence and
averaged over the sequences (DeepSeek-V3's sequence-wise balance loss, DeepSeek-AI 2024,
eqs. 17-20; Megatron-Core's ``seq_aux_loss``), so that it does not depend on which sequences
share a micro-batch: a run under dp trains exactly as one process does. Each MoE layer adds
``aux_loss_coef`` times it to the training loss through `AuxLoss` (Megatron-Core's
``MoEAuxLossAutoScaler``): the layer's output is unchanged and its backward adds the gradient of
the auxiliary loss, so no loss function or pipeline schedule needs to know about it. The value
of the last forward is kept in ``MoE.aux_loss``.

The routed rows are gathered, weighted and combined in the activation dtype (the autocast
dtype under autocast, as torchtitan permutes in bf16), never as fp32 copies of the T*k rows.

Expert parallelism (`apply_ep`) is Megatron-Core's parallel folding (Liu et al. 2025, "MoE
Parallel Folding"; ``parallel_state.initialize_model_parallel``'s expert groups): the expert
layers run ``etp x ep x edp`` over the ranks attention runs ``tp x cp x dp`` on, etp innermost,
then ep, so ep may span tp, cp and dp ranks (``etp x ep`` divides ``tp x cp x dp``, as
`Strategy.problems` says for every runtime). Under tensor parallelism each tp rank routes its own
tokens: under sequence parallel the shard it holds (no all-gather of the MoE input), without it
its slice of the replicated input, the outputs gathered after the layer (Megatron-Core refuses
MoE with tp > 1 without sequence parallel; the Engine runs it at the cost of that all-gather, so
that every strategy the cost model prices runs). Each rank keeps ``n_experts / ep`` experts, as
DTensors sharded on the expert dimension over the ep mesh, and with ``etp > 1`` also on their
width over etp consecutive ranks (w1, w3 by columns, w2 by rows, as Megatron-LM splits an MLP).
Tokens reach the rank that owns their expert with ``all_to_all_single`` (gloo has it on CPU,
uneven splits included): the per-expert counts are exchanged first, then the rows (`AllToAll`,
whose backward is the reverse all-to-all); under etp the rows the etp group received are
gathered over it, each rank computes its slice of every expert's width, and the partial outputs
are reduce-scattered back (``MoEAlltoAllTokenDispatcher``'s order). Expert gradients are summed
over edp (the ranks holding the same experts, which may be tp ranks) and divided by dp x cp, as
the data-parallel wrappers divide dense gradients: by `reduce_moe_grads` once per step, or under
FSDP2 by sharding the experts over edp (``fully_shard`` with that divide factor, as torchtitan
does). The router's and the shared experts' gradients, partial on each tp rank, are summed over
tp by `reduce_moe_grads` (as Megatron-LM sums the sequence-parallel weights'), and the
load-balancing loss sums its counts and probabilities over the tp shards as over cp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

    from torch.distributed.device_mesh import DeviceMesh

    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy
    from autosearch.distributed.context_parallel import ContextParallel

# Switch Transformer's alpha = 1e-2 (Fedus et al. 2022, sec. 2.2), also Megatron-Core examples'
# --moe-aux-loss-coeff; Hugging Face models bring their own router_aux_loss_coef.
AUX_LOSS_COEF = 1e-2


# What the Trainer multiplies the loss by before backward (fp16's loss scale; 1 otherwise): a
# module global, not an attribute of `AuxLoss`, which torch.compile cannot read.
_aux_loss_scale = 1.0


def set_aux_loss_scale(scale: float) -> None:
    global _aux_loss_scale
    _aux_loss_scale = float(scale)


class AuxLoss(torch.autograd.Function):
    """Identity on `output` whose backward also sends gradient 1 to `aux_loss` (a scalar already
    multiplied by its coefficient and, through `add`, by the loss scale): ``loss + aux_loss``
    without touching the loss function. Under fp16 the Trainer sets the loss scale
    (`set_aux_loss_scale`) to the loss scaler's before each step, so the auxiliary loss is
    scaled as the main loss is (Megatron-Core's ``MoEAuxLossAutoScaler.set_loss_scale``)."""

    @staticmethod
    def add(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        """`output`, with `aux_loss` (times the loss scale) added to the loss its backward
        sees."""
        return AuxLoss.apply(output, aux_loss * _aux_loss_scale)

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


class AllToAll(torch.autograd.Function):
    """Rows of `x` sent to the ranks of `group` (`in_splits` rows to each, in rank order) and
    received from them (`out_splits`); the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _own_seq(x: torch.Tensor, group) -> torch.Tensor:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=1)[rank].contiguous()


class ScatterToSequence(torch.autograd.Function):
    """This rank's slice of a sequence replicated over `group` (dim 1), whose backward gathers
    the slices' gradients (Megatron-LM's ``scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _own_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_seq(grad, ctx.group), None


class GatherFromSequence(torch.autograd.Function):
    """The whole sequence from its slices over `group` (dim 1), whose backward keeps this
    rank's slice of the (replicated) gradient (``gather_from_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_seq(grad, ctx.group), None


class ReduceFromGroup(torch.autograd.Function):
    """Sum over `group` whose backward is the identity: the output of work split over the
    group's ranks (Megatron-LM's ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class Experts(nn.Module):
    """`n_experts` SwiGLU MLPs stored stacked (w2(silu(w1 x) * w3 x), Shazeer 2020)."""

    weight_names = ("w1", "w3", "w2")  # each [n_experts, ...]: expert parallelism slices dim 0
    hidden_dims = {"w1": 2, "w3": 2, "w2": 1}  # the dim of width f: etp slices it
    no_etp_reason = ""  # why etp cannot split these experts (none: it can)

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of `x` sorted by expert, `counts[e]` rows for local expert e."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        hidden = F.silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts)
        return grouped_mm(hidden, w2, counts)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """Each expert from its own generator, seeded from the global RNG and its global index,
        so that an expert starts the same whichever rank holds it (or a shard of it)."""
        if self.w1.is_meta:  # built on the meta device: initialised once materialized
            return
        base = int(torch.randint(0, 2**31 - 1, (), device="cpu").item())
        for w, s in ((self.w1, std), (self.w3, std), (self.w2, out_std)):
            local, offset = _local(w), _offset(w)
            window = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
            for e in range(local.shape[0]):
                gen = torch.Generator(device=local.device).manual_seed(base + offset[0] + e)
                full = torch.empty(w.shape[1:], device=local.device).normal_(0.0, s, generator=gen)
                local[e].copy_(full[window])  # this rank's etp slice (FSDP shards dim 0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ w[e]`` for each expert e, rows grouped by expert (`counts[e]` each):
    ``x [M, k]``, ``w [E, k, n]`` -> ``[M, n]``. One ``torch._grouped_mm`` kernel where it takes
    the operands (any float dtype on CPU; bf16 with 16-byte aligned widths on CUDA GPUs of
    compute capability 9.0 or later, as torchtitan uses it), else a loop of matmuls. Under
    autocast both run in the autocast dtype (``_grouped_mm`` is not on autocast's lists)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, w = x.to(dtype), w.to(dtype)
    if _grouped_mm_takes(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    return _looped_mm(x, w, counts)


@torch.compiler.disable
def _looped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` as a loop of matmuls, run eagerly under ``torch.compile``: its split sizes
    are the routed counts, data Dynamo cannot trace (GuardOnDataDependentSymNode); torchtitan's
    for-loop experts take the same graph break."""
    with torch.autocast(x.device.type, enabled=False):  # already in the autocast dtype
        outs = [rows @ w[e] for e, rows in enumerate(x.split(counts.tolist()))]
    return torch.cat(outs) if outs else x.new_empty((0, w.shape[-1]))


def _grouped_mm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands (its checks in ATen's Blas.cpp)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or x.shape[0] == 0:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # its meta kernel (what torch.compile traces with) takes bf16 only
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    aligned = all(d % 8 == 0 for d in (*x.shape[1:], *w.shape[1:]))  # 16 bytes of bf16
    return aligned and torch.cuda.get_device_capability(x.device) >= (9, 0)


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (a DTensor over the ep mesh under expert parallelism)."""
    return w.to_local() if hasattr(w, "to_local") else w


def _offset(w: torch.Tensor) -> tuple[int, ...]:
    """The global index of this rank's first element of `w` in each dim."""
    if not hasattr(w, "to_local"):
        return (0,) * w.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dt: Any = w  # a DTensor
    _, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return tuple(int(o) for o in offset)


class FusedExperts(nn.Module):
    """SwiGLU experts in transformers' layout (Mixtral, Qwen3-MoE ``*Experts``):
    ``gate_up_proj: [E, 2f, d]`` (gate rows first) and ``down_proj: [E, d, f]``, applied with
    ``F.linear`` as transformers does, so a Hugging Face model keeps its weights and names."""

    weight_names: tuple[str, ...] = ("gate_up_proj", "down_proj")
    hidden_dims: dict[str, int] = {}  # gate and up rows fused in one dim: not split over etp
    no_etp_reason = (
        "transformers' fused experts (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3) hold the gate and "
        "up rows in one matrix, which the Engine does not split over tp"
    )

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        gate, up = grouped_mm(x, gate_up.transpose(1, 2), counts).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, down.transpose(1, 2), counts)


class MoE(nn.Module):
    """Routed top-k SwiGLU experts plus optional shared experts, dropless.

    Under context parallel (set by the Engine) a sequence is split over the cp ranks: the
    load-balancing loss sums its counts and probabilities over them, so it is the whole
    sequence's (Megatron-Core reduces them over its tp x cp group the same way).

    Args:
        dim: model width.
        hidden: width of one routed expert.
        n_experts, top_k: routed experts, and experts per token.
        router: ``softmax`` (Mixtral, Qwen) or ``sigmoid`` (DeepSeek-V3: the k scores are
            normalised to sum to 1).
        shared_hidden: total width of the shared experts (0: none).
        aux_loss_coef: weight of the load-balancing loss (0: none).
        norm_topk_prob: renormalise the k softmax weights to sum to 1 (Mixtral; Qwen3-MoE's
            ``norm_topk_prob``).
    """

    context_parallel: "ContextParallel | None" = None
    # Whether the routing weights scale each expert's input rows instead of its output (Llama 4:
    # ``experts(w * x)``, not ``w * experts(x)``; the same for experts linear in their input).
    weight_inputs = False

    def __init__(
        self,
        *,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        router: str = "softmax",
        shared_hidden: int = 0,
        aux_loss_coef: float = AUX_LOSS_COEF,
        norm_topk_prob: bool = True,
    ):
        super().__init__()
        self.n_experts, self.top_k, self.router_kind = n_experts, top_k, router
        self.aux_loss_coef, self.norm_topk_prob = aux_loss_coef, norm_topk_prob
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts: Experts | FusedExperts = Experts(n_experts, dim, hidden)
        self.shared_experts = _SwiGLU(dim, shared_hidden) if shared_hidden else None
        # set by apply_ep: the ep group, the ranks holding the same experts, dp x cp
        self.ep_group: dist.ProcessGroup | None = None
        self.etp_group: dist.ProcessGroup | None = None  # the ranks splitting each expert
        self.tp_group: dist.ProcessGroup | None = None  # the ranks sharing out each sequence
        self.sequence_parallel = True  # whether the input is this rank's shard already
        self.edp_mesh: "DeviceMesh | None" = None
        self.grad_divide = 1
        self.aux_loss: torch.Tensor | None = None  # of the last forward, detached
        self.router_logits: torch.Tensor | None = None  # of the last forward, when recorded
        self.record_router_logits = False  # for a model-level aux loss (Hugging Face's)

    def route(
        self, x: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T, k] in `dtype` (default x's), experts [T, k], probabilities [T, E]) of
        tokens `x` [T, d]."""
        logits = self.gate(x)
        if self.record_router_logits:
            self.router_logits = logits
        logits = logits.float()
        if self.router_kind == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
            weights, experts = scores.topk(self.top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
        else:
            probs = scores = logits.softmax(-1)
            weights, experts = scores.topk(self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(dtype or x.dtype), experts, probs

    def balance_loss(self, experts: torch.Tensor, probs: torch.Tensor, batch: int) -> torch.Tensor:
        """E * sum_i f_i P_i per sequence, averaged over the `batch` sequences (module
        docstring)."""
        experts, probs = experts.view(batch, -1), probs.view(batch, -1, self.n_experts)
        counts = torch.zeros(batch, self.n_experts, device=probs.device, dtype=probs.dtype)
        counts.scatter_add_(1, experts, torch.ones_like(experts, dtype=probs.dtype))
        tokens, prob_sums = probs.shape[1], probs.sum(1)
        if self.tp_group is not None:  # the sequence's shards over tp (parallel folding)
            dist.all_reduce(counts, group=self.tp_group)
            # the gradient of each shard's probabilities stays on its rank, and the router's
            # gradient is summed over tp after backward (`reduce_moe_grads`)
            prob_sums = ReduceFromGroup.apply(prob_sums, self.tp_group)
            tokens *= dist.get_world_size(self.tp_group)
        cp = self.context_parallel
        if cp is not None:  # the whole sequence's: summed over the cp ranks (with autograd)
            from torch.distributed.nn.functional import all_reduce

            group = cp.mesh.get_group()
            dist.all_reduce(counts, group=group)
            prob_sums = all_reduce(prob_sums, group=group)
            tokens *= cp.cp
        f = counts / (tokens * self.top_k)
        return self.n_experts * (f * prob_sums / tokens).sum(1).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.tp_group
        if group is None or self.sequence_parallel:
            return self._forward(x)
        # tp > 1 without sequence parallel: the input is the whole sequence on every tp rank;
        # each routes its own slice (parallel folding) and the slices are gathered again
        n = dist.get_world_size(group)
        if x.dim() != 3 or x.shape[1] % n:
            raise ValueError(
                f"the MoE layer splits each sequence over the tp={n} ranks (parallel folding): "
                f"input of shape {tuple(x.shape)} has a sequence length not divisible by {n}; "
                "use a sequence length divisible by tp"
            )
        return GatherFromSequence.apply(self._forward(ScatterToSequence.apply(x, group)), group)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, device = x.shape, x.device.type
        x = x.reshape(-1, shape[-1])
        # under autocast the router, the routed rows and the shared experts read one cast of
        # the (fp32 residual stream's) input, not one each, and the routed rows are permuted,
        # weighted and combined in that dtype, as torchtitan does (its output is in the autocast
        # dtype, as a dense MLP's is): no [T*k, d] tensor in fp32
        if torch.is_autocast_enabled(device):
            x = x.to(torch.get_autocast_dtype(device))
        weights, experts, probs = self.route(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # routed copies grouped by expert, tokens in order
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.n_experts)
        # index_select: its backward is index_add_ (not index_put_ with accumulate, which sorts)
        rows, w = x.index_select(0, token), weights.flatten()[order, None]
        if self.weight_inputs:  # Llama 4: the experts see their rows scaled by the weights
            y = self._run_experts(rows * w, counts)
        else:
            y = self._run_experts(rows, counts) * w
        out = self.add_shared(torch.zeros_like(x).index_add_(0, token, y), x)
        out = out.reshape(shape)
        if self.aux_loss_coef > 0:
            aux = self.balance_loss(experts, probs, shape[0] if len(shape) == 3 else 1)
            self.aux_loss = aux.detach()
            if self.training and torch.is_grad_enabled():
                out = AuxLoss.add(out, aux * self.aux_loss_coef)
        return out

    def add_shared(self, routed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output `routed` plus the shared experts' of the tokens `x`
        [T, d] (a family with another shared expert overrides it: Qwen2-MoE's gated one)."""
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts(x)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs of `rows` (sorted by expert, `counts` per expert), the experts held
        here or, under expert parallelism, on the ranks of ``ep_group`` (Megatron-Core's
        ``MoEAlltoAllTokenDispatcher``): the rows go to the ranks holding their experts over
        ep, and under expert tensor parallelism the rows received by the ranks of
        ``etp_group`` are gathered over it, each rank computes its slice of every expert's
        width, and the partial outputs are reduce-scattered back to the rows' ranks."""
        ep_group, etp_group = self.ep_group, self.etp_group
        if ep_group is None and etp_group is None:
            return self.experts(rows, counts)
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        local = self.n_experts // ep
        got, recv = rows, counts
        splits: tuple[list[int], list[int]] = ([], [])
        if ep_group is not None:
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=ep_group)  # [source rank, local expert]
            splits = (recv.view(ep, local).sum(1).tolist(), counts.view(ep, local).sum(1).tolist())
            got = AllToAll.apply(rows, *splits, ep_group)
        sizes: list[int] = []
        if etp_group is not None:
            got, recv, sizes = _gather_rows(got, recv, etp_group)
        # received by source rank, then expert: regroup by local expert (stable: sources in order)
        expert_of = torch.arange(local, device=rows.device).repeat(recv.numel() // local)
        by_expert = torch.repeat_interleave(expert_of, recv).argsort(stable=True)
        y = self.experts(got[by_expert], recv.view(-1, local).sum(0))
        back = torch.empty_like(y).index_copy_(0, by_expert, y)
        if etp_group is not None:
            back = _reduce_scatter_rows(back, sizes, etp_group)
        if ep_group is not None:
            back = AllToAll.apply(back, splits[1], splits[0], ep_group)
        return back


def _gather_rows(
    x: torch.Tensor, counts: torch.Tensor, group
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The rows of every rank of `group` (in rank order) and their per-expert counts, and how
    many rows each rank sent: an all-gather of uneven sizes, as an all-to-all of `x` repeated
    (gloo has no uneven all-gather); its backward sums each rank's rows' gradients."""
    n = dist.get_world_size(group)
    all_counts = [torch.empty_like(counts) for _ in range(n)]
    dist.all_gather(all_counts, counts, group=group)
    sizes = [int(c.sum()) for c in all_counts]
    got = AllToAll.apply(x.repeat(n, 1), sizes, [x.shape[0]] * n, group)
    return got, torch.cat(all_counts), sizes


def _reduce_scatter_rows(y: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Each rank's rows of `y` (`sizes[r]` rows for rank r, in rank order) summed over the
    ranks of `group` and sent to it: the reverse of `_gather_rows`."""
    n = dist.get_world_size(group)
    mine = sizes[dist.get_rank(group)]
    parts = AllToAll.apply(y, [mine] * n, sizes, group)
    return parts.view(n, mine, *y.shape[1:]).sum(0)


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def moe_of(spec: "ModelSpec", *, aux_loss_coef: float = AUX_LOSS_COEF) -> MoE:
    """The MoE layer of `spec` (its ``moe`` block)."""
    m = spec.moe
    if m is None:  # pragma: no cover - callers check
        raise SpecError(f"model {spec.name!r} has no moe block")
    coef = aux_loss_coef if m.load_balancing == "aux_loss" else 0.0
    return MoE(
        dim=spec.hidden_size,
        hidden=m.ffn_hidden_size,
        n_experts=m.n_experts,
        top_k=m.top_k,
        router=m.router,
        shared_hidden=m.n_shared_experts * m.shared_ffn_hidden_size,
        aux_loss_coef=coef,
    )


def sequence_parallel_style():
    """The tensor-parallel style of an MoE layer under sequence parallel: it takes this rank's
    shard of the sequence as a local tensor and hands back its output for that shard (each tp
    rank routes its own tokens: Megatron-Core's parallel folding; `apply_ep`)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Shard(1),),
        use_local_input=True,
        output_layouts=(Shard(1),),
        desired_output_layouts=(Shard(1),),
        use_local_output=True,
    )


# ---- expert parallelism -------------------------------------------------------------------------
def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def ep_problems(strategy: "Strategy", model: nn.Module) -> list[str]:
    """Why the Engine cannot run `strategy`'s expert parallelism on `model`'s MoE
    layers (empty when it can); the layout rules shared with the cost model are
    `Strategy.problems`'."""
    ep, etp = getattr(strategy, "ep", 1), getattr(strategy, "etp", 1)
    layers = moe_layers(model)
    out: list[str] = []
    if ep == 1 and etp == 1:
        return out
    if not layers:
        out.append(
            f"ep={ep}, etp={etp}: this model has no autosearch MoE layers "
            "(autosearch.models.transformer"
            " built from a ModelSpec with moe, or a Mixtral / Qwen3-MoE transformers model); "
            "set ep=1 and etp=1"
        )
    if strategy.tp % etp:
        out.append(
            f"etp={etp} must divide tp={strategy.tp} (each expert is split over etp of the tp "
            "ranks); use a divisor of tp"
        )
    if etp > 1 and any(not m.experts.hidden_dims for m in layers):
        reason = next(m.experts.no_etp_reason for m in layers if not m.experts.hidden_dims)
        out.append(f"etp={etp}: {reason}; set etp=1")
    for m in layers[:1]:
        width = {getattr(m.experts, n).shape[d] for n, d in m.experts.hidden_dims.items()}
        if etp > 1 and any(w % etp for w in width):
            out.append(f"etp={etp} must divide the experts' width {min(width)}; use one that does")
    ranks = strategy.tp * strategy.dp * strategy.cp
    if ranks % (ep * etp):
        out.append(
            f"ep*etp = {ep}*{etp} must divide tp*dp*cp = {ranks} (the expert layers run etp x "
            "ep x edp over the ranks attention runs tp x dp x cp on); use an ep that divides it"
        )
    for layer in layers:
        if layer.n_experts % ep:
            out.append(f"ep={ep} does not divide the {layer.n_experts} experts; use one that does")
            break
    return out


def expert_mesh(
    mesh: "DeviceMesh", *, ep: int, pp: int, dp: int, cp: int, tp: int, etp: int = 1
) -> "DeviceMesh":
    """The mesh of the expert layers over the same ranks as `mesh` (pp, dp, cp, tp order):
    ``(pp, edp, ep, etp)`` with etp x ep x edp = tp x cp x dp, etp innermost, then ep
    (Megatron-Core's parallel folding, ``parallel_state.initialize_model_parallel``'s expert
    groups): every rank of tp x cp x dp routes its own tokens, so ep may span tp, cp and dp
    ranks, and etp consecutive ranks split each expert's width."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh.mesh.reshape(pp, dp * cp * tp // (ep * etp), ep, etp)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "etp"))


def apply_ep(
    module: nn.Module,
    emesh: "DeviceMesh",
    *,
    etp: int = 1,
    tp_mesh: "DeviceMesh | None" = None,
    sequence_parallel: bool = True,
) -> None:
    """Keep this rank's ``n_experts / ep`` experts of every MoE layer, as DTensors sharded on
    the expert dimension over the ep mesh (so checkpoints, gradient norms and FSDP2 see whole
    weights, as in torchtitan), and route over ep. With ``etp`` > 1 each expert's width is
    split over etp consecutive ranks too (w1, w3 column-wise, w2 row-wise: Megatron-LM's MLP
    split), a DTensor over (ep, etp). Under tensor parallelism (`tp_mesh`) each tp rank routes
    its own shard of the sequence: the shard sequence parallel hands it, or (without sequence
    parallel) its slice of the replicated input, gathered again after the layer."""
    from torch.distributed.tensor import DTensor, Shard

    names = emesh.mesh_dim_names or ()
    size = {n: emesh.size(names.index(n)) for n in names}
    group, rank = emesh.get_group("ep"), emesh.get_local_rank("ep")
    t = emesh.get_local_rank("etp") if etp > 1 else 0
    tp = tp_mesh.size() if tp_mesh is not None else 1
    for layer in moe_layers(module):
        local = layer.n_experts // size["ep"]
        experts = layer.experts
        for name in experts.weight_names:
            w = getattr(experts, name)
            keep = w.detach()[rank * local : (rank + 1) * local]
            mesh, placements = emesh["ep"], [Shard(0)]
            if etp > 1:
                dim = experts.hidden_dims[name]
                width = w.shape[dim] // etp
                keep = keep.narrow(dim, t * width, width)
                mesh, placements = emesh["ep", "etp"], [Shard(0), Shard(dim)]
            shard = DTensor.from_local(
                keep.clone(), mesh, placements, run_check=False, shape=w.shape, stride=w.stride()
            )
            setattr(experts, name, nn.Parameter(shard, requires_grad=w.requires_grad))
        layer.ep_group = group if size["ep"] > 1 else None
        layer.etp_group = emesh.get_group("etp") if etp > 1 else None
        layer.tp_group = tp_mesh.get_group() if tp > 1 and tp_mesh is not None else None
        layer.sequence_parallel = sequence_parallel
        layer.edp_mesh = emesh["edp"]
        layer.grad_divide = size["edp"] * size["ep"] * size["etp"] // tp  # dp x cp


def shard_experts(module: nn.Module, **fsdp) -> None:
    """FSDP2 over edp for every expert-parallel MoE layer's experts, gradients divided by
    dp x cp, before the blocks are sharded over dp (which then leave the experts alone).

    FSDP2 divides by a factor other than the group size inside the reduce-scatter
    (``PREMUL_SUM``), which gloo lacks: there it sums and divides after (over edp > 1 only: a
    group of one copies and divides without a collective)."""
    from torch.distributed.fsdp import fully_shard

    for layer in moe_layers(module):
        if layer.edp_mesh is not None:
            sharded = fully_shard(layer.experts, mesh=layer.edp_mesh, **fsdp)
            sharded.set_gradient_divide_factor(float(layer.grad_divide))
            group = layer.edp_mesh.get_group()
            if dist.get_backend(group) == "gloo" and group.size() > 1:
                sharded.set_force_sum_reduction_for_comms(True)


def expert_param_names(module: nn.Module) -> list[str]:
    """Names of the expert-parallel weights (which DDP must leave to `reduce_expert_grads`)."""
    return [
        f"{name}.experts.{w}"
        for name, sub in module.named_modules()
        if isinstance(sub, MoE) and sub.edp_mesh is not None
        for w in sub.experts.weight_names
    ]


def reduce_moe_grads(parts: list[nn.Module], *, experts: bool) -> None:
    """Once per step, after backward: with `experts` (unless FSDP2 shards them) sum
    the expert gradients over edp and divide them by dp x cp, as DDP averages the dense ones
    over dp x cp (FSDP2's sharded experts do it themselves); and under tensor parallelism sum
    the router's and the shared experts' gradients over tp (each tp rank routed its own tokens:
    Megatron-LM sums the sequence-parallel weights' gradients over tp the same way)."""
    for part in parts:
        for layer in moe_layers(part):
            if experts and layer.edp_mesh is not None:
                group = layer.edp_mesh.get_group() if layer.edp_mesh.size() > 1 else None
                _reduce(_expert_weights(layer), group, layer.grad_divide)
            if layer.tp_group is not None:
                routed = {id(w) for w in _expert_weights(layer)}
                rest = [w for w in layer.parameters() if id(w) not in routed]
                _reduce(rest, layer.tp_group, 1)


def _reduce(weights: "Sequence[torch.Tensor]", group, divide: int) -> None:
    """Sum the (local) gradients of `weights` over `group` (None: no collective), then divide."""
    grads = [_local(w.grad) for w in weights if w.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    if divide != 1:
        flat.div_(divide)
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))


def _expert_weights(layer: MoE) -> list[torch.Tensor]:
    return [getattr(layer.experts, name) for name in layer.experts.weight_names]
