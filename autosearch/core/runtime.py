"""How the training runtime executes a strategy: the software half of the cost model.

The same strategy costs different time and memory under different runtimes: PyTorch autocast keeps
fp32 parameters and casts per use, Megatron-LM (2021) keeps fp16 parameters and fp32 master copies
in the optimizer; FlashAttention never stores the s x s attention matrix; DDP overlaps the gradient
all-reduce with the backward pass, Megatron-LM 2021 did not. These choices are data, as hardware
is.
"""

from __future__ import annotations

from dataclasses import dataclass

from autosearch.core.errors import SpecError


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """Runtime behaviour that the analytic model needs to know.

    Args:
        name: a label.
        flash_attention: fused attention (no s x s matrix stored or streamed; Dao et al. 2022).
        dp_overlap: fraction of the backward pass during which data-parallel gradient reduction
            runs hidden (1.0 = bucketed overlap as DDP / FSDP2, Li et al. 2020; 0.0 = after
            backward).
        tp_overlap: fraction of tensor-parallel communication hidden behind GEMMs (0 by default:
            neither Megatron-LM 2021 nor DTensor without async-TP overlaps it).
        low_precision_params: parameters are stored in the 16-bit amp dtype with fp32 master
            copies in the optimizer (Megatron-LM, Micikevicius et al. 2018); otherwise parameters
            are fp32 and autocast casts them per use (PyTorch AMP).
        grad_reduce_bytes: bytes per gradient element in data-parallel reductions.
        pp_scatter_gather: pipeline sends are split over the tp ranks and re-gathered over the
            fast intra-node link (Narayanan et al. 2021, sec. 4.1).
        step_overhead_s: fixed host-side cost per optimizer step (Python, launch queues).
    """

    name: str = "torch"
    flash_attention: bool = True
    dp_overlap: float = 1.0
    tp_overlap: float = 0.0
    low_precision_params: bool = False
    grad_reduce_bytes: int = 4
    pp_scatter_gather: bool = False
    step_overhead_s: float = 0.0

    @classmethod
    def get(cls, name_or_options: "str | RuntimeOptions | None") -> "RuntimeOptions":
        if name_or_options is None:
            return TORCH
        if isinstance(name_or_options, RuntimeOptions):
            return name_or_options
        try:
            return RUNTIMES[name_or_options]
        except KeyError:
            raise SpecError(
                f"unknown runtime {name_or_options!r}; choose one of {', '.join(RUNTIMES)}"
            ) from None


# PyTorch as the Engine runs it: autocast, SDPA flash attention, DDP/FSDP2 with overlapped
# gradient reduction, torch.distributed.pipelining (each tp rank sends its own full activation).
TORCH = RuntimeOptions(name="torch")

# Megatron-LM as used for SC'21 Table 1 (Narayanan et al. 2021): fused but not flash attention,
# fp16 parameters with fp32 master weights, fp16 gradient all-reduce after the backward pass
# (no overlap), scatter/gather of pipeline messages over the tp ranks.
MEGATRON_SC21 = RuntimeOptions(
    name="megatron-sc21",
    flash_attention=False,
    dp_overlap=0.0,
    tp_overlap=0.0,
    low_precision_params=True,
    grad_reduce_bytes=2,
    pp_scatter_gather=True,
)

RUNTIMES = {r.name: r for r in (TORCH, MEGATRON_SC21)}
