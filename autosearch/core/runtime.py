"""How the training runtime executes a strategy: the software half of the cost model.

The same strategy costs different time and memory under different runtimes: PyTorch autocast keeps
fp32 parameters and casts per use, Megatron-LM (2021) keeps fp16 parameters and fp32 master copies
in the optimizer; FlashAttention never stores the s x s attention matrix; DDP overlaps the gradient
all-reduce with the backward pass, Megatron-LM 2021 did not. These choices are data, as hardware
is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autosearch.core import data, dimensions
from autosearch.core._io import check_keys
from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import HardwareProfile
    from autosearch.core.model_spec import ModelSpec
    from autosearch.core.strategy import Strategy


MOE_DISPATCHERS = ("alltoall", "deepep")
# How a runtime runs the scans of Mamba-2 and Gated DeltaNet mixers (`RuntimeOptions.ssm_scan`)
SSM_SCANS = ("fused", "torch_chunked")
# Megatron-Core's fine-grained activation offloading modules (--offload-modules) the cost model
# prices: the MoE experts' (megatron-core docs/user-guide/features/
# fine_grained_activation_offloading.md names also attn_norm, qkv_linear, core_attn,
# attn_proj, mlp_norm and fused_group_mlp)
OFFLOAD_MODULES = ("expert_fc1", "moe_act")
# Kinds of block a runtime must support to train a model that has them (a runtime's
# ``supports``), by the mixer name of `autosearch.core.layers`. The `torch` preset (the Engine,
# autosearch/models/ssm.py) trains both with its plain-PyTorch scans (``ssm_scan:
# torch_chunked``)
MODEL_FEATURES = {
    "mamba": "Mamba-2 mixers (M in the layer pattern)",
    "gdn": "Gated DeltaNet mixers (G in the layer pattern)",
    "parallel_hybrid": "attention and Mamba-2 in parallel in one layer (P in the layer pattern)",
    "mamba1": "Mamba-1 mixers (S in the layer pattern)",
    "kda": "Kimi Delta Attention mixers (G with gdn.gate_rank)",
}
# the feature a runtime needs to train each mixer that is not attention (its name otherwise)
_FEATURE_OF_MIXER = {"attention+mamba": "parallel_hybrid"}


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
        autocast_fp32_params: the runtime computes with fp32 parameters under 16-bit autocast
            (the Engine, where no FSDP2 mixed-precision policy gathers them in the amp dtype):
            each micro-batch casts the weights and their gradients, and the fp32 activations
            each linear reads (`cost_models.terms.compute.autocast_casts_s`).
        grad_reduce_bytes: bytes per gradient element in data-parallel reductions.
        pp_scatter_gather: pipeline sends are split over the tp ranks and re-gathered over the
            fast intra-node link (Narayanan et al. 2021, sec. 4.1).
        step_overhead_s: fixed host-side cost per optimizer step (Python, launch queues).
        collective_overhead_s: the runtime's own cost per collective it issues (Python dispatch,
            hooks, buffer copies), on top of NCCL's; it counts where collectives run one after
            another on the critical path (per-partition reductions, latency-bound gathers).
        zero3_gathers_per_layer: separate parameter all-gathers per transformer block and pass
            under ZeRO-3 / FSDP: 1 where a block is one unit (FSDP2 ``fully_shard`` per block,
            FSDP1 auto-wrap), one per parameter-holding submodule where the runtime fetches
            submodule by submodule (DeepSpeed ZeRO-3).
        zero3_overlap: `dp_overlap` under ZeRO-3 when it differs (DeepSpeed turns
            ``overlap_comm`` on by default for stage 3 only); negative: the same.
        reduce_bucket_params: gradient reduction bucket in parameters (0: one per unit).
        grad_reduce_per_partition: ZeRO-2 reduces each bucket with one ``reduce`` to each
            partition's owner (DeepSpeed ``average_tensor``), not one reduce-scatter: d
            collectives per bucket.
        collective_copies_per_rank: kernels the runtime launches per rank of the group around
            each ZeRO-3 / FSDP collective (list-based ``all_gather`` / ``reduce_scatter`` of
            torch < 1.10 copy every rank's slice with its own kernel), each the hardware
            profile's `kernel_launch_s`: a cost that grows with the ranks.
        zero3_max_live_params: parameters ZeRO-3 keeps gathered at once (DeepSpeed
            ``stage3_max_live_parameters``), at least one fetch; 0: two transformer blocks (FSDP:
            the current unit and the prefetched one).
        description: one line on what the runtime is.
        attention_kernel: the fused attention kernel it runs (``fa2``, ``cudnn``, ``triton``):
            its efficiency is the hardware profile's `attention.kernels` entry when the profile
            has one, else the profile's (calibrated) flash efficiency.
        async_tp_overlap: `tp_overlap` when the strategy asks for async tensor parallelism.
        main_grad_fp32: gradients accumulate in a full fp32 buffer on every rank (Megatron-Core
            ``main_grad``), sharded or not.
        param_gather_bytes: bytes per parameter element that FSDP / ZeRO-3 all-gathers; 0 means
            the amp dtype's size.
        sp_saves_gathered_input: with sequence parallel, a linear layer saves its all-gathered
            (full-sequence) input for the weight gradient (DTensor); else the shard, gathered
            again in backward (Megatron-Core).
        fsdp_backward_gather_exposed: FSDP issues the backward all-gather of the next unit only
            after the current unit's gradients (FSDP1 ``BACKWARD_POST``): it is not hidden.
        elementwise_traffic: memory traffic of the elementwise work (norms, activations,
            rotary, residuals, casts) relative to one kernel per op in eager mode; fused
            kernels (TransformerEngine) move less.
        compiled_elementwise_traffic: the same under ``torch.compile`` (strategy.compile).
        loss_bytes_per_logit: bytes the loss keeps per logit (the logits, an fp32 copy and
            the saved softmax in eager mode; less when fused or compiled).
        compiled_loss_bytes_per_logit: the same with a compiled loss.
        loss_parallel_bytes_per_logit: bytes per logit at the loss's peak when tensor
            parallelism splits the vocabulary and the loss runs on the shards (DTensor
            ``loss_parallel``); 0 means the same as `loss_bytes_per_logit`.
        compiled_loss_parallel_bytes_per_logit: the same with a compiled loss.
        attention_kv_expanded: keys and values reach the attention kernel at the full head
            count (``repeat_kv`` before SDPA, torchtitan), not at ``n_kv_heads``.
        cp_all_gather_kv: context parallel all-gathers the keys and values of the whole
            sequence for each attention call and its backward holds them next to fp32 gradient
            accumulators (torch's ring attention with the ``allgather`` rotater).
        pp_kept_output_bytes_per_logit: bytes per logit the last pipeline stage keeps for
            every micro-batch of the step (torch.distributed.pipelining returns the merged
            outputs, the logits in the model's output dtype); 0 when the runtime does not keep
            them.
        fp8_all_gather: FSDP gathers float8 weights when the strategy uses fp8.
        fp8_saves_fp8_inputs: float8 linears keep the float8 copy of their input for backward
            (TransformerEngine), not the 16-bit one (torchao).
        fused_swiglu: the runtime's SwiGLU is one fused kernel that keeps 3 x sbf, not 4
            (TransformerEngine); `compile` fuses it too.
        ssm_scan: how the runtime runs the chunked scans of Mamba-2 and Gated DeltaNet mixers:
            ``fused``, mamba_ssm's and flash-linear-attention's Triton kernels
            (`MambaSpec.ssd_kernels`; Megatron-Core, Hugging Face modeling code with the kernels
            installed), or ``torch_chunked``, the Engine's plain-PyTorch scans
            (autosearch/models/ssm.py: `MambaSpec.torch_scan`, `GatedDeltaNetSpec.torch_scan`),
            which materialise each chunk's decays and products in fp32 and save them.
        moe_load_imbalance: under dropless routing with real (not forced-balanced) routing, the
            tokens of the busiest expert-parallel rank over the mean: the expert GEMMs and the
            all-to-all of every MoE layer wait for that rank (1: balanced).
        moe_dispatcher: how tokens reach their experts: ``alltoall`` (NCCL all-to-all of every
            routed copy: Megatron-Core's alltoall dispatcher, torchtitan) or ``deepep`` (DeepEP's
            normal kernels: a token crosses the network once per destination node and is
            forwarded over NVLink; Megatron-Core's flex dispatcher, NeMo Automodel).
        moe_a2a_overlap: fraction of the dispatch and combine hidden behind another
            micro-batch's compute (Megatron-Core ``--overlap-moe-expert-parallel-comm``, the
            "1F1B A2A overlap"); 0 without it.
        moe_a2a_overlap_when_on: `moe_a2a_overlap` of a run that turns the overlap on
            (`as_run(moe_a2a_overlap=True)`): a property of the runtime's overlap, not of the run.
        moe_layer_host_s: the host's time one MoE layer adds to a micro-batch, forward and
            backward (Python, kernel launches): added to the layer's GPU work, not hidden
            behind it, since each MoE layer's forward synchronises the host with the device
            before its experts (the tokens per expert copied to the host), which empties the
            GPU's queue (cost_models/terms/experts.py `rank_s`).
        moe_expert_host_s: the host's time for one local expert of one MoE layer, forward and
            backward, added to `moe_layer_host_s`: TransformerEngine's grouped linears before
            a fused grouped-GEMM kernel run one cuBLAS GEMM per expert on several streams and
            allocate, quantize and swizzle each expert's fp8 scaling factors with their own
            small kernels (Megatron-LM docs/discussions/deepseek-v3-gb200-optimization, sections
            1 item 3, 2.1.2, 2.1.3), so the host's work of a layer grows with the experts a
            rank holds; launched after the layer's sync, so the GPU waits for it.
        moe_shared_expert_overlap: the shared experts' forward and backward run while the
            all-to-all dispatch and combine are in flight (Megatron-Core
            ``--moe-shared-expert-overlap``).
        mtp: the runtime trains a model's multi-token prediction modules
            (`ModelSpec.mtp_layers`: Megatron-Core ``--mtp-num-layers``); a runtime without
            them trains the model alone, and the cost model prices it so.
        moe_probs_in_activation: the routing probabilities multiply the experts' activation
            (Megatron-Core 0.13+: ``activation_func_with_probs``), so the combine is a plain
            scatter that keeps no copy of the experts' output for backward; False: they
            multiply the experts' output at the combine, which keeps it.
        param_bytes: bytes per element of the parameters the runtime keeps between steps when
            it keeps no separate master copy (not `low_precision_params`): 4 for fp32; 2 when
            the model is built in bf16 and trained by ``torch.optim`` as is, whose Adam moments
            then take the parameters' dtype too (NeMo Automodel's ``model.torch_dtype``).
            Gradients accumulated unsharded over micro-batches stay in the fp32 reduce dtype
            (FSDP2 upcasts them to ``reduce_dtype``).
        allocator_reserve_fraction: memory the caching allocator reserves beyond the live
            tensors at the peak (fragmentation), as a fraction of them.
        kernel_efficiency: {GPU architecture: factor} on the compute efficiencies (GEMM and
            fused attention) of the hardware profile, for a runtime whose build predates that
            architecture's kernels (e.g. CUDA 11.8 on Hopper); 1 where not listed.
        expert_kernel_efficiency: {GPU architecture: factor} on the routed experts' grouped
            GEMMs there, beyond `kernel_efficiency`, for a release whose MoE expert kernels on
            that architecture predate their tuned versions; 1 where not listed.
        fused_attention_max_head_dim: {GPU architecture: the largest head size (of scores or
            values) the runtime's fused attention kernels take there}; a model with larger
            heads runs the unfused attention core (s x s scores in memory) on that
            architecture. TransformerEngine before 2.5 refuses cuDNN's fused attention on
            Blackwell for heads above 128 and FlashAttention for MLA's unequal heads
            (transformer_engine/common/fused_attn/fused_attn.cpp @v2.4 line 221), so
            DeepSeek-V3's 192 / 128 heads fall back to UnfusedDotProductAttention there.
        base: the preset this one is a dated version of: it inherits every field it does not
            set (runtimes.yaml; a base may have a base of its own: ``nemo-25.04`` -> ``nemo`` ->
            ``megatron-core``), and shares its `framework`.
        supports: strategy dimensions the runtime can run (``cp``, ``fp8``, ``compile``,
            ``async_tp``, ``selective_op``, ``recompute_num_layers``, ``uneven_pp``, ``ep``,
            ``etp``, ``lora_tp`` ...: `autosearch.core.dimensions.feature_names`).
        devices: {feature: the devices that can run it} for the supported features that not
            every device runs: ``cpu``, ``cuda``, or ``cuda>=8.9`` (a minimum compute
            capability). The cost model prices the hardware it is given and ignores this; the
            Engine refuses a strategy on a device that cannot run it (`cannot_run_on`).
        sources: where each value comes from (docs/runtimes.md has the details).
        host_adam_params_per_s_per_core: parameters one host core updates per second in the
            runtime's offloaded Adam step (``offload_optimizer``); the host's memory bandwidth
            bounds it too (`cost_models.terms.offload`).
        activation_offload_overlap: fraction of the activation copies to and from the host
            (``offload_activations``) hidden behind the layers' compute: 0 where they run on
            the compute stream, 1 where a side stream prefetches them a layer ahead.
        activation_offload_modules: the modules whose inputs one run's Megatron-Core offloads
            to the host (``--fine-grained-activation-offloading --offload-modules``; priced:
            ``expert_fc1``, ``moe_act``); set per run by `as_run(offload_modules=...)`, hidden
            as `activation_offload_overlap` says.
    """

    name: str = "torch"
    description: str = ""
    flash_attention: bool = True
    attention_kernel: str = ""
    dp_overlap: float = 1.0
    tp_overlap: float = 0.0
    async_tp_overlap: float = 0.0
    low_precision_params: bool = False
    autocast_fp32_params: bool = False
    main_grad_fp32: bool = False
    grad_reduce_bytes: int = 4
    param_gather_bytes: int = 0
    pp_scatter_gather: bool = False
    sp_saves_gathered_input: bool = False
    fsdp_backward_gather_exposed: bool = False
    elementwise_traffic: float = 1.0
    compiled_elementwise_traffic: float = 1.0
    loss_bytes_per_logit: float = 10.0
    compiled_loss_bytes_per_logit: float = 10.0
    loss_parallel_bytes_per_logit: float = 0.0
    compiled_loss_parallel_bytes_per_logit: float = 0.0
    attention_kv_expanded: bool = False
    cp_all_gather_kv: bool = False
    pp_kept_output_bytes_per_logit: float = 0.0
    fp8_all_gather: bool = False
    fp8_saves_fp8_inputs: bool = False
    fused_swiglu: bool = False
    ssm_scan: str = "fused"
    param_bytes: int = 4
    allocator_reserve_fraction: float = 0.0
    moe_load_imbalance: float = 1.0
    moe_dispatcher: str = "alltoall"
    moe_a2a_overlap: float = 0.0
    moe_a2a_overlap_when_on: float = 0.0
    moe_layer_host_s: float = 0.0
    moe_expert_host_s: float = 0.0
    moe_shared_expert_overlap: bool = False
    moe_probs_in_activation: bool = False
    mtp: bool = False
    step_overhead_s: float = 0.0
    collective_overhead_s: float = 0.0
    zero3_gathers_per_layer: float = 1.0
    zero3_overlap: float = -1.0
    reduce_bucket_params: float = 0.0
    grad_reduce_per_partition: bool = False
    collective_copies_per_rank: float = 0.0
    zero3_max_live_params: float = 0.0
    kernel_efficiency: tuple[tuple[str, float], ...] = ()  # (architecture, factor) pairs
    expert_kernel_efficiency: tuple[tuple[str, float], ...] = ()  # (architecture, factor) pairs
    fused_attention_max_head_dim: tuple[tuple[str, int], ...] = ()  # (architecture, size) pairs
    supports: tuple[str, ...] = ()
    devices: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (feature, devices) pairs
    sources: tuple[str, ...] = ()
    base: str | None = None
    host_adam_params_per_s_per_core: float = 0.0
    activation_offload_overlap: float = 0.0
    activation_offload_modules: tuple[str, ...] = ()

    @property
    def framework(self) -> str:
        """The framework this preset is a version of (its `base`, else itself): runs of every
        version are evidence for the framework's error band. A chain of bases ends at the
        framework: ``nemo-25.04`` -> ``nemo`` -> ``megatron-core``."""
        name, seen = self.base or self.name, {self.name}
        while name not in seen and name in RUNTIMES and RUNTIMES[name].base:
            seen.add(name)
            name = RUNTIMES[name].base or name
        return name

    def as_run(
        self,
        *,
        grad_reduce_in_fp32: bool | None = None,
        moe_dispatcher: str | None = None,
        moe_a2a_overlap: bool | None = None,
        moe_shared_expert_overlap: bool | None = None,
        full_iteration_cuda_graph: bool | None = None,
        layer_cuda_graph: bool | None = None,
        balanced_routing: bool | None = None,
        offload_modules: str | None = None,
    ) -> "RuntimeOptions":
        """This preset as one run configured it: the switches a recipe or a command line sets
        on top of its release (None: the preset's own). Each maps to the runtime's behaviour;
        how much it hides or costs stays the preset's:

        - ``grad_reduce_in_fp32`` (Megatron-Core's flag): False keeps gradients in bf16 (a bf16
          main_grad buffer and reduction: `main_grad_fp32` off, 2 bytes); True in fp32.
        - ``moe_dispatcher``: ``alltoall`` or ``deepep`` (Megatron-Core's flex dispatcher).
        - ``moe_a2a_overlap`` (``--overlap-moe-expert-parallel-comm``): the preset's
          `moe_a2a_overlap_when_on` of the dispatch and combine hidden; False: none.
        - ``moe_shared_expert_overlap`` (``--moe-shared-expert-overlap``).
        - ``full_iteration_cuda_graph`` (``cuda_graph_impl="full_iteration"``): the host
          launches one graph per iteration, so a MoE layer costs no host time of its own
          (`moe_layer_host_s` and `moe_expert_host_s` 0).
        - ``layer_cuda_graph`` (Megatron-Core's per-layer graphs, ``enable_cuda_graph``, on a
          run whose MoE layers drop and pad to capacity): `CudaGraphManager` replays each
          whole `TransformerLayer` (megatron-core 0.12 transformer_layer.py `__call__`), which
          the padded layer allows (static shapes; its dispatcher has no device-to-host sync,
          `cuda_sync_point` "no_sync"), so a MoE layer costs no host time of its own either.
          Dropless MoE layers have data-dependent shapes and are not captured whole: a run
          sets it only with token drop padded to capacity (``balanced_routing``).
        - ``balanced_routing`` (forced load balance, token drop padded to capacity): every
          expert-parallel rank gets the mean of the tokens (`moe_load_imbalance` 1).
        - ``offload_modules`` (``--offload-modules``, ``+``-joined: ``expert_fc1+moe_act``):
          Megatron-Core's fine-grained activation offloading of those modules' inputs
          (`activation_offload_modules`).

        Example:
            >>> RUNTIMES["nemo-25.04"].as_run(grad_reduce_in_fp32=True).grad_reduce_bytes
            4
        """
        changes: dict[str, Any] = {}
        if grad_reduce_in_fp32 is not None:
            changes["main_grad_fp32"] = grad_reduce_in_fp32
            changes["grad_reduce_bytes"] = 4 if grad_reduce_in_fp32 else 2
        if moe_dispatcher is not None:
            if moe_dispatcher not in MOE_DISPATCHERS:
                raise SpecError(
                    f"moe_dispatcher {moe_dispatcher!r} is not one the cost model knows; choose "
                    f"one of {', '.join(MOE_DISPATCHERS)}"
                )
            changes["moe_dispatcher"] = moe_dispatcher
        if moe_a2a_overlap is not None:
            changes["moe_a2a_overlap"] = self.moe_a2a_overlap_when_on if moe_a2a_overlap else 0.0
        if moe_shared_expert_overlap is not None:
            changes["moe_shared_expert_overlap"] = moe_shared_expert_overlap
        if layer_cuda_graph and not balanced_routing:
            raise SpecError(
                "layer_cuda_graph: Megatron-Core captures a MoE layer whole only when it drops "
                "and pads its tokens to capacity (static shapes); set balanced_routing too, or "
                "leave the per-layer graphs out"
            )
        if full_iteration_cuda_graph or layer_cuda_graph:
            changes["moe_layer_host_s"] = 0.0
            changes["moe_expert_host_s"] = 0.0
        if balanced_routing:
            changes["moe_load_imbalance"] = 1.0
        if offload_modules:
            names = tuple(n for n in offload_modules.split("+") if n)
            unknown = [n for n in names if n not in OFFLOAD_MODULES]
            if unknown:
                raise SpecError(
                    f"offload_modules {'+'.join(unknown)!r}: the cost model prices the "
                    f"fine-grained offload of {', '.join(OFFLOAD_MODULES)} only; drop the others "
                    "or price them (cost_models/terms/experts.py offloaded_row_bytes)"
                )
            changes["activation_offload_modules"] = names
        changes = {k: v for k, v in changes.items() if getattr(self, k) != v}
        return replace(self, **changes) if changes else self

    @classmethod
    def get(cls, name_or_options: "str | RuntimeOptions | None") -> "RuntimeOptions":
        if name_or_options is None:
            return RUNTIMES["torch"]
        if isinstance(name_or_options, RuntimeOptions):
            return name_or_options
        try:
            return RUNTIMES[name_or_options]
        except KeyError:
            framework, _, date = name_or_options.rpartition("-")
            dated = [n for n in RUNTIMES if framework and n.startswith(f"{framework}-")]
            releases = (
                f" the releases of {framework} with a preset are {', '.join(dated)};"
                if date[:1].isdigit() and dated
                else ""
            )
            raise SpecError(
                f"unknown runtime {name_or_options!r};{releases} choose one of "
                f"{', '.join(RUNTIMES)} (a release without a preset: its framework's, or add "
                "one to cost_models/runtimes.yaml)"
            ) from None

    def unsupported(
        self, strategy: "Strategy", model: "ModelSpec | None" = None
    ) -> dict[str, str]:
        """{dimension: how the strategy uses it} for each dimension it uses (on `model`, where
        given) that this runtime cannot run."""
        used = dimensions_used(strategy, model)
        return {dim: how for dim, how in used.items() if dim not in self.supports}

    def cannot_run_on(self, strategy: "Strategy", device: str) -> dict[str, tuple[str, ...]]:
        """{feature: the devices that can run it} for each feature of `strategy` that this
        runtime supports but not on `device` (``cpu``, or ``cuda:9.0``: type and compute
        capability)."""
        runs_on = dict(self.devices)
        return {
            name: runs_on[name]
            for name in dimensions_used(strategy)
            if name in runs_on and not any(device_meets(device, req) for req in runs_on[name])
        }

    def cannot_train(self, model: "ModelSpec") -> list[str]:
        """The kinds of block of `model` this runtime does not train (`MODEL_FEATURES`), each
        as a message naming the runtimes that do."""
        mixers = {_FEATURE_OF_MIXER.get(layer.mixer, layer.mixer) for layer in model.layers}
        if "gdn" in mixers and model.gdn is not None and model.gdn.gate_rank is not None:
            mixers = (mixers - {"gdn"}) | {"kda"}  # not Gated DeltaNet's layer: its own kind
        needed = [f for f in MODEL_FEATURES if f in mixers]
        out = []
        for feature in needed:
            if feature in self.supports:
                continue
            # those that train the most kinds of block first, then by name; a dated release
            # that inherits the kind from its base is named by its base
            others = sorted(
                (
                    r
                    for r in RUNTIMES.values()
                    if feature in r.supports
                    and not (r.base in RUNTIMES and feature in RUNTIMES[r.base].supports)
                ),
                key=lambda r: (-len(set(MODEL_FEATURES) & set(r.supports)), r.name),
            )
            fix = (
                f"runtimes that do: {', '.join(r.name for r in others)} (--runtime "
                f"{others[0].name})"
                if others
                else (
                    "no runtime preset does yet (one whose supports lists "
                    f"{feature!r}, in cost_models/runtimes.yaml or a RuntimeOptions, prices it)"
                )
            )
            out.append(f"runtime {self.name!r} does not train {MODEL_FEATURES[feature]}; {fix}")
        return out

    def lacks(self, strategy: "Strategy", model: "ModelSpec | None" = None) -> list[str]:
        """The dimensions of `strategy` (on `model`, where given) this runtime cannot run, each
        as a message."""
        supported = ", ".join(self.supports) or "none of " + ", ".join(dimensions.feature_names())
        return [
            f"runtime {self.name!r} cannot run {how} (it supports {supported})"
            for how in self.unsupported(strategy, model).values()
        ]

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, what: str) -> "RuntimeOptions":
        kwargs = check_keys(data, cls, what=what)
        for key in ("supports", "sources"):
            if key in kwargs:
                kwargs[key] = tuple(kwargs[key] or ())
        if "devices" in kwargs:
            devices = kwargs["devices"] or {}
            if not isinstance(devices, dict) or not all(
                isinstance(v, list) and all(isinstance(d, str) for d in v)
                for v in devices.values()
            ):
                raise SpecError(
                    f"{what}: devices must map features to lists of devices (cpu, cuda, "
                    f"cuda>=8.9), got {devices!r}"
                )
            kwargs["devices"] = tuple((str(k), tuple(v)) for k, v in devices.items())
        named = [*kwargs.get("supports", ()), *(f for f, _ in kwargs.get("devices", ()))]
        known = (*dimensions.feature_names(), *MODEL_FEATURES)
        unknown = [f for f in named if f not in known]
        if unknown:
            raise SpecError(
                f"{what}: supports or devices list {', '.join(map(repr, unknown))}, which no "
                f"dimension or kind of block declares; known: {', '.join(known)}"
            )
        if kwargs.get("moe_dispatcher", "alltoall") not in MOE_DISPATCHERS:
            raise SpecError(
                f"{what}: moe_dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, got "
                f"{kwargs['moe_dispatcher']!r}"
            )
        if kwargs.get("ssm_scan", "fused") not in SSM_SCANS:
            raise SpecError(
                f"{what}: ssm_scan must be one of {', '.join(SSM_SCANS)}, got "
                f"{kwargs['ssm_scan']!r}"
            )
        for name in ("kernel_efficiency", "expert_kernel_efficiency"):
            if name not in kwargs:
                continue
            factors = kwargs[name] or {}
            if not isinstance(factors, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1
                for v in factors.values()
            ):
                raise SpecError(
                    f"{what}: {name} must map architectures to factors in (0, 1], got {factors!r}"
                )
            kwargs[name] = tuple((str(k), float(v)) for k, v in factors.items())
        if "fused_attention_max_head_dim" in kwargs:
            limits = kwargs["fused_attention_max_head_dim"] or {}
            if not isinstance(limits, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in limits.values()
            ):
                raise SpecError(
                    f"{what}: fused_attention_max_head_dim must map architectures to head "
                    f"sizes (positive integers), e.g. {{blackwell: 128}}, got {limits!r}"
                )
            kwargs["fused_attention_max_head_dim"] = tuple(
                (str(k), int(v)) for k, v in limits.items()
            )
        return cls(**kwargs)

    def fused_attention(self, model: "ModelSpec", profile: "HardwareProfile") -> bool:
        """Whether `model`'s attention core runs fused (no s x s scores) on `profile`: the
        runtime's `flash_attention`, unless its kernels there do not take the model's heads."""
        if not self.flash_attention:
            return False
        limit = dict(self.fused_attention_max_head_dim).get(profile.architecture)
        if limit is None:
            return True
        if model.mla is not None:
            heads = max(model.mla.qk_head_dim, model.mla.v_head_dim)
        else:
            heads = model.head_dim
        return heads <= limit

    def on(self, profile: "HardwareProfile") -> "HardwareProfile":
        """`profile` as this runtime's kernels run on it: GEMM and fused-attention efficiencies
        times `kernel_efficiency[profile.architecture]` (the profile itself where 1)."""
        factor = dict(self.kernel_efficiency).get(profile.architecture, 1.0)
        return profile if factor == 1.0 else profile.scaled_compute(factor, why=self.name)


# Why a feature needs the devices the `torch` preset's `devices` names (the Engine's refusals).
DEVICE_NEEDS = {
    "async_tp": (
        "async TP needs CUDA symmetric memory and Inductor's micro-pipelined TP pass, which "
        "exist only on CUDA; run it on GPUs or set async_tp=false"
    ),
    "fp8": (
        "float8 matmuls (torch._scaled_mm) need float8 units: CUDA compute capability 8.9 or "
        "newer (L4, H100, H200), or the CPU; run it there or set fp8=none"
    ),
}


def engine_lacks(strategy: "Strategy", device: str | None = "cpu") -> list[str]:
    """The dimensions the Engine does not run (the `torch` runtime preset's `supports` in
    cost_models/runtimes.yaml) or not on `device` (its `devices`; None: not checked, the device
    is not known here), each with what to do instead."""
    runtime = RUNTIMES["torch"]
    problems = [
        f"the Engine cannot run {how} on this machine's torch.distributed yet; leave it out, or "
        f"export the strategy to a runtime that has it (`autosearch export --to torchtitan`)"
        for how in runtime.unsupported(strategy).values()
    ]
    for name, devices in runtime.cannot_run_on(strategy, device).items() if device else ():
        why = DEVICE_NEEDS.get(name, f"run it on {' or '.join(devices)}")
        problems.append(
            f"{name} cannot run on this device ({device}; it runs on {', '.join(devices)}): {why}"
        )
    return problems


def device_meets(device: str, requirement: str) -> bool:
    """Whether `device` (``cpu``, ``cuda:9.0``) is one `requirement` names (``cpu``, ``cuda``,
    ``cuda>=8.9``: CUDA with at least that compute capability)."""
    kind, _, capability = device.partition(":")
    want, _, minimum = requirement.partition(">=")
    if kind != want:
        return False
    if not minimum:
        return True
    have = tuple(int(x) for x in capability.split(".")) if capability else (0,)
    return have >= tuple(int(x) for x in minimum.split("."))


def dimensions_used(strategy: "Strategy", model: "ModelSpec | None" = None) -> dict[str, str]:
    """{feature: how} for each feature of today's stacks the strategy uses (on `model`, where
    given: LoRA under tp), the names of `RuntimeOptions.supports`, declared with their
    dimensions in `autosearch.core.dimensions`."""
    return dimensions.features_used(strategy, model)


def _load_runtimes() -> dict[str, RuntimeOptions]:
    """The presets of `cost_models/runtimes.yaml` (found without importing cost_models)."""
    presets = data.read_data("runtimes.yaml", what="runtime presets")["runtimes"]

    def fields_of(name: str, chain: tuple[str, ...] = ()) -> dict[str, Any]:
        """A preset's fields: its `base` preset's (a dated release names the preset it
        refines, which may have a base of its own), then its own."""
        fields = dict(presets[name])
        base = fields.get("base")
        if base is None:
            return fields
        if base not in presets or base in (*chain, name):
            raise SpecError(
                f"runtime {name!r}: base {base!r} must be another preset of runtimes.yaml, not "
                f"one that has it as a base ({' -> '.join((*chain, name, base))}); known: "
                f"{', '.join(presets)}"
            )
        return {**fields_of(base, (*chain, name)), **fields}

    return {
        name: RuntimeOptions.from_dict({"name": name, **fields_of(name)}, what=f"runtime {name!r}")
        for name in presets
    }


RUNTIMES = _load_runtimes()
# PyTorch as the Engine runs it (the default), and Megatron-LM as in SC'21 Table 1.
TORCH = RUNTIMES["torch"]
MEGATRON_SC21 = RUNTIMES["megatron-sc21"]
