"""Offload to host memory: what leaves the device, what the host holds, and the time the copies
and the host's optimizer step add.

Three dimensions (`autosearch.core.dimensions`), each off by default, where nothing here is read:

- ``offload_optimizer`` (ZeRO-Offload, Ren et al. 2021): the optimizer states leave the device;
  each step the reduced gradient shard goes down (device to host) and the updated parameters
  come back up (host to device); the Adam step runs on the host's cores.
- ``offload_params`` (ZeRO-Infinity, Rajbhandari et al. 2021; FSDP2 ``CPUOffloadPolicy``): the
  ZeRO-3 parameter shard lives on the host and each gather copies it up first, forward and
  backward of every micro-batch, behind the compute as the gather's prefetch is.
- ``offload_activations="layers"`` (``torch.autograd.graph.save_on_cpu``; Megatron-Core
  ``--cpu-offloading``): every tensor a layer saves for backward goes down in forward and comes
  back in backward; the device keeps the layer computing and the one in flight.

The host is hardware data (`HardwareProfile.host`: the link per GPU, the node's memory, memory
bandwidth and cores); how far copies hide and how fast the host's Adam runs are runtime data
(`RuntimeOptions.activation_offload_overlap`, `host_adam_params_per_s_per_core`,
cost_models/runtimes.yaml). Written here because no library prices offload; the mechanisms
are those of the papers and runtimes named above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from cost_models.formulas import microbatches_in_flight
from cost_models.terms._base import ACT_BYTES, Context, LayerCosts, reads
from cost_models.terms.compute import ADAM_BYTES_PER_PARAM

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.strategy import Strategy
    from cost_models.terms.data_parallel import DataParallelCost

# Layers whose saved tensors stay on the device under activation offload: the one computing
# and the one whose copy is in flight (save_on_cpu packs a layer's tensors as they are saved;
# Megatron-Core's offload handler reloads one layer ahead of backward).
LAYERS_ON_DEVICE = 2


class OffloadCost(NamedTuple):
    """What offload changes on one device, per optimizer step."""

    dp: "DataParallelCost"  # the model states left on the device
    activations_bytes: float  # device activations (the caller's, or what offload leaves)
    host_bytes: float  # host memory this device's offload holds
    copies_exposed_s: float  # host-device copies not hidden behind compute
    optimizer_s: float  # the optimizer step: the device's, or the host's when offloaded


def used(s: "Strategy") -> bool:
    """Whether `s` offloads anything (off, the cost model reads nothing here)."""
    return s.offload_optimizer or s.offload_params or s.offload_activations != "none"


def host_rates(ctx: Context) -> tuple[float, float, float]:
    """(host-device bandwidth per GPU and direction, host memory bandwidth per GPU, host cores
    per GPU), the node's shared by its GPUs; a SpecError where the profile has no host."""
    from autosearch.core.errors import SpecError

    prof = ctx.profile
    host = prof.host
    if host is None:
        raise SpecError(
            f"hardware profile {prof.name!r} describes no host (its link to the GPUs, memory "
            "and cores): add a host: section (cost_models/profiles/h100-sxm.yaml has one) or "
            "turn offload off"
        )
    gpus = prof.gpus_per_node
    return (
        host.achieved_bandwidth_bytes_per_s,
        host.memory_bandwidth_bytes_per_s / gpus,
        host.cores / gpus,
    )


@reads(
    "offload_optimizer",
    "offload_params",
    "offload_activations",
    "zero_stage",
    "amp",
    "global_batch_size",
    "dp",
    "micro_batch_size",
    "pp",
    "virtual_stages",
    "pipeline_schedule",
)
def cost(
    s: "Strategy",
    ctx: Context,
    dp: "DataParallelCost",
    device_optimizer_s: float,
    param_shard: float,
    ranks: tuple[int | float, ...],
    layer: LayerCosts,
    recompute_layer_s: float,
    activations_bytes: float,
    layer_kept_bytes: float,
) -> OffloadCost:
    """Offload's effect on one device of the heaviest pipeline rank.

    Args:
        dp: the data-parallel cost without offload (its model-state bytes on the device).
        device_optimizer_s: the device's optimizer step without offload.
        param_shard: parameters of this device's ZeRO-3 shard (what offload_params moves).
        ranks: layers per pipeline rank.
        layer: one layer's costs (its forward and backward are the copies' window).
        recompute_layer_s: what recompute adds to one layer's backward.
        activations_bytes: the device's activations at the peak without offload.
        layer_kept_bytes: one layer's saved tensors per micro-batch under the recompute.
    """
    rt = ctx.runtime
    link_bw, mem_bw, cores = host_rates(ctx)
    ab = ACT_BYTES[s.amp]
    m = s.grad_accum_steps
    Ls = max(ranks)
    low = rt.low_precision_params
    params_b, grads_b, optimizer_b = dp.params_bytes, dp.grads_bytes, dp.optimizer_bytes
    host = copies = 0.0
    optimizer_s = device_optimizer_s
    overlap = rt.zero3_overlap if s.zero_stage >= 3 and rt.zero3_overlap >= 0 else rt.dp_overlap
    fwd_window = Ls * layer.fwd_s * overlap
    bwd_window = Ls * (layer.bwd_s + recompute_layer_s) * overlap

    def exposed(seconds: float, window: float) -> float:
        return max(seconds - window, 0.0)

    if s.offload_optimizer:
        # the parameters this device steps: its optimizer bytes over their bytes per
        # parameter (fp32 master + two moments = 12 with 16-bit parameters, Rajbhandari et al.
        # 2020; two moments in the parameter dtype otherwise)
        state = 12.0 if low else 2.0 * rt.param_bytes
        stepped = optimizer_b / state
        # the host keeps the states, a gradient copy in fp32 (DeepSpeed's pinned fp32
        # partition, torchao's CPU gradient) and, where the device's parameters are the
        # master copy (fp32 under autocast), a host copy of them to update
        grad_host = 4.0 if low else float(rt.param_bytes)
        host += stepped * (state + grad_host + (0.0 if low else rt.param_bytes))
        optimizer_b = 0.0
        # down: the reduced gradient shard, as the backward produces it (bucket by bucket)
        grad_dev = 4.0 if (rt.main_grad_fp32 or not low) else ab
        down = stepped * grad_dev / link_bw
        # up: the updated parameters before the next forward (no delayed update): exposed;
        # with offload_params they stay on the host, and the next gather copies them up
        up = 0.0 if s.offload_params else stepped * (ab if low else rt.param_bytes) / link_bw
        copies += exposed(down, bwd_window) + up
        # Adam on the host: bound by its cores (the runtime's kernel) or by its memory,
        # ADAM_BYTES_PER_PARAM of traffic per parameter (Ren et al. 2021, sec. 5.1: CPU-Adam)
        # (a runtime without a host optimizer of its own, rate 0, cannot run it: it is
        # refused before pricing, and priced by the memory bound alone when asked unchecked)
        rate = rt.host_adam_params_per_s_per_core * cores
        optimizer_s = max(stepped / rate if rate else 0.0, stepped * ADAM_BYTES_PER_PARAM / mem_bw)
        if s.zero_stage >= 2 and (low or s.offload_params):
            # the gradient shard leaves as it is reduced (DeepSpeed copies each reduced bucket
            # to its pinned buffer; FSDP2's CPUOffloadPolicy moves the sharded gradients to
            # the CPU): the device keeps none between steps
            grads_b = 0.0
    if s.offload_params:
        shard_bytes = param_shard * (ab if low else rt.param_bytes)
        params_b = max(0.0, params_b - shard_bytes)
        host += shard_bytes
        # each gather copies the shard up first: forward and backward of every micro-batch,
        # prefetched with the gather (FSDP2 copies in on the all-gather stream)
        up = shard_bytes / link_bw
        copies += m * (exposed(up, fwd_window) + exposed(up, bwd_window))
    activations = activations_bytes
    if s.offload_activations != "none":
        in_flight = microbatches_in_flight(
            s.pipeline_schedule, s.pp, s.grad_accum_steps, s.virtual_stages
        )
        offloaded = in_flight * Ls * layer_kept_bytes
        kept = min(Ls, LAYERS_ON_DEVICE) * layer_kept_bytes
        activations = max(kept, activations_bytes - offloaded + kept)
        host += offloaded
        # down in forward, up in backward, one layer's tensors per layer per micro-batch;
        # the runtime hides `activation_offload_overlap` of them behind the layer's compute
        ov = rt.activation_offload_overlap
        one_way = Ls * layer_kept_bytes / link_bw
        copies += m * (
            exposed(one_way, ov * Ls * layer.fwd_s)
            + exposed(one_way, ov * Ls * (layer.bwd_s + recompute_layer_s))
        )
    return OffloadCost(
        dp=dp._replace(params_bytes=params_b, grads_bytes=grads_b, optimizer_bytes=optimizer_b),
        activations_bytes=activations,
        host_bytes=host,
        copies_exposed_s=copies,
        optimizer_s=optimizer_s,
    )
