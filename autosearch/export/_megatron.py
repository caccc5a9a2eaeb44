"""Megatron-LM (`pretrain_gpt.py` arguments, Megatron-Core era): the parallel layout, the batch
sizes and the whole model shape, so the argument list runs as it is.

The flag names were checked against the packages (megatron-core 0.16.1, megatron-bridge 0.3.1,
installed with `pip install --no-deps` and read, not imported):

* Megatron-LM copies every argument whose name is a field of Megatron-Core's config dataclasses
  into them (megatron-bridge `training/mlm_compat/arguments.py`, `_transformer_config_from_args`:
  ``for f in dataclasses.fields(config_class): if hasattr(args, f.name)``), so a flag
  ``--num-layers`` is the field ``num_layers`` of `megatron/core/transformer/transformer_config.py`
  (`TransformerConfig`), `megatron/core/model_parallel_config.py` (`ModelParallelConfig`) or
  `megatron/core/distributed/distributed_data_parallel_config.py`.
* Arguments that are not config fields are read by name in megatron-bridge
  `training/mlm_compat/arguments.py` and `mlm_compat/model.py` (``args.swiglu``,
  ``args.group_query_attention``, ``args.position_embedding_type``,
  ``args.untie_embeddings_and_output_weights``, ``args.max_position_embeddings``), the batch sizes
  by `megatron/core/num_microbatches_calculator.py` (`init_num_microbatches_calculator`), the
  tokenizer by megatron-bridge `training/tokenizers/config.py`.
* `--num-layers-per-virtual-pipeline-stage` and `--seq-length` live only in Megatron-LM's
  `megatron/training/arguments.py`, which no PyPI package ships; they are cited from there.
"""

from __future__ import annotations

import itertools

from autosearch.export._architecture import architecture_of
from autosearch.export._base import (
    Exported,
    Exporter,
    FieldMap,
    declared_mappings,
    refusal,
    shell_words,
)
from autosearch.export._launch import PLACEHOLDERS, require, script

# flag -> (value kind, where the name comes from). tests/test_export.py builds an argparse parser
# from this table and parses every exported argument list with it.
FLAGS: dict[str, tuple[str, str]] = {
    "--num-layers": ("int", "TransformerConfig.num_layers"),
    "--hidden-size": ("int", "TransformerConfig.hidden_size"),
    "--num-attention-heads": ("int", "TransformerConfig.num_attention_heads"),
    "--group-query-attention": ("switch", "mlm_compat/arguments.py args.group_query_attention"),
    "--num-query-groups": ("int", "TransformerConfig.num_query_groups"),
    "--ffn-hidden-size": ("int", "TransformerConfig.ffn_hidden_size"),
    "--swiglu": ("switch", "mlm_compat/arguments.py args.swiglu (gated_linear_unit + silu)"),
    "--normalization": ("str", "TransformerConfig.normalization (LayerNorm, RMSNorm)"),
    "--position-embedding-type": (
        "str",
        "GPTModel / MambaModel(position_embedding_type=...) learned_absolute|rope|none",
    ),
    "--disable-bias-linear": ("switch", "TransformerConfig.add_bias_linear = False"),
    "--hidden-dropout": ("float", "TransformerConfig.hidden_dropout"),
    "--attention-dropout": ("float", "TransformerConfig.attention_dropout"),
    "--untie-embeddings-and-output-weights": ("switch", "mlm_compat/model.py args.untie_..."),
    "--seq-length": ("int", "Megatron-LM megatron/training/arguments.py"),
    "--max-position-embeddings": ("int", "mlm_compat/model.py args.max_position_embeddings"),
    "--tokenizer-type": ("str", "megatron-bridge training/tokenizers/config.py tokenizer_type"),
    "--vocab-size": ("int", "megatron-bridge training/tokenizers/config.py vocab_size"),
    "--micro-batch-size": ("int", "num_microbatches_calculator.py micro_batch_size"),
    "--global-batch-size": ("int", "num_microbatches_calculator.py global_batch_size"),
    "--tensor-model-parallel-size": ("int", "ModelParallelConfig.tensor_model_parallel_size"),
    "--pipeline-model-parallel-size": ("int", "ModelParallelConfig.pipeline_model_parallel_size"),
    "--num-layers-per-virtual-pipeline-stage": (
        "int",
        "Megatron-LM megatron/training/arguments.py",
    ),
    "--num-virtual-stages-per-pipeline-rank": (
        "int",
        "Megatron-LM megatron/training/arguments.py",
    ),
    "--sequence-parallel": ("switch", "ModelParallelConfig.sequence_parallel"),
    "--context-parallel-size": ("int", "ModelParallelConfig.context_parallel_size"),
    "--decoder-first-pipeline-num-layers": ("int", "TransformerConfig.num_layers_in_first_..."),
    "--decoder-last-pipeline-num-layers": ("int", "TransformerConfig.num_layers_in_last_..."),
    "--pipeline-model-parallel-layout": (
        "str",
        "TransformerConfig.pipeline_model_parallel_layout (megatron-core >= 0.13)",
    ),
    "--fp8-format": ("str", "TransformerConfig.fp8 (e4m3, hybrid)"),
    "--fp8-recipe": ("str", "TransformerConfig.fp8_recipe (tensorwise, delayed, ...)"),
    "--tp-comm-overlap": ("switch", "ModelParallelConfig.tp_comm_overlap"),
    "--recompute-granularity": (
        "str",
        "TransformerConfig.recompute_granularity (full, selective)",
    ),
    "--recompute-method": ("str", "TransformerConfig.recompute_method (uniform, block)"),
    "--recompute-num-layers": ("int", "TransformerConfig.recompute_num_layers"),
    "--use-distributed-optimizer": ("switch", "DistributedDataParallelConfig.use_distributed_..."),
    "--use-torch-fsdp2": ("switch", "megatron-bridge training/config.py use_torch_fsdp2"),
    "--bf16": ("switch", "ModelParallelConfig.bf16"),
    "--fp16": ("switch", "ModelParallelConfig.fp16"),
    "--expert-model-parallel-size": ("int", "ModelParallelConfig.expert_model_parallel_size"),
    "--expert-tensor-parallel-size": ("int", "ModelParallelConfig.expert_tensor_parallel_size"),
    # mixture of experts (Megatron-LM `_add_moe_args`; each copied into the config field named)
    "--num-experts": ("int", "TransformerConfig.num_moe_experts"),
    "--moe-router-topk": ("int", "TransformerConfig.moe_router_topk"),
    "--mtp-num-layers": ("int", "TransformerConfig.mtp_num_layers (_add_mtp_args)"),
    "--moe-ffn-hidden-size": ("int", "TransformerConfig.moe_ffn_hidden_size"),
    "--moe-shared-expert-intermediate-size": (
        "int",
        "TransformerConfig.moe_shared_expert_intermediate_size (all shared experts' width)",
    ),
    "--moe-layer-freq": ("str", "TransformerConfig.moe_layer_freq (an int or a list)"),
    "--moe-grouped-gemm": ("switch", "TransformerConfig.moe_grouped_gemm"),
    "--moe-token-dispatcher-type": ("str", "TransformerConfig.moe_token_dispatcher_type"),
    "--moe-router-score-function": ("str", "TransformerConfig.moe_router_score_function"),
    "--moe-router-load-balancing-type": (
        "str",
        "TransformerConfig.moe_router_load_balancing_type",
    ),
    "--moe-aux-loss-coeff": ("float", "TransformerConfig.moe_aux_loss_coeff"),
    "--moe-router-enable-expert-bias": (
        "switch",
        "TransformerConfig.moe_router_enable_expert_bias",
    ),
    "--moe-expert-capacity-factor": ("float", "TransformerConfig.moe_expert_capacity_factor"),
    # multi-head latent attention (MLATransformerConfig, the same file)
    "--multi-latent-attention": ("switch", "MLATransformerConfig.multi_latent_attention"),
    "--q-lora-rank": ("int", "MLATransformerConfig.q_lora_rank"),
    "--kv-lora-rank": ("int", "MLATransformerConfig.kv_lora_rank"),
    "--qk-head-dim": ("int", "MLATransformerConfig.qk_head_dim (the non-rotary part)"),
    "--qk-pos-emb-head-dim": ("int", "MLATransformerConfig.qk_pos_emb_head_dim"),
    "--v-head-dim": ("int", "MLATransformerConfig.v_head_dim"),
    "--recompute-modules": ("list", "TransformerConfig.recompute_modules"),
    # offload to host memory (megatron-core 0.16 optimizer/optimizer_config.py,
    # transformer/transformer_config.py)
    "--optimizer-cpu-offload": ("switch", "OptimizerConfig.optimizer_cpu_offload"),
    "--optimizer-offload-fraction": ("float", "OptimizerConfig.optimizer_offload_fraction"),
    "--overlap-cpu-optimizer-d2h-h2d": (
        "switch",
        "OptimizerConfig.overlap_cpu_optimizer_d2h_h2d",
    ),
    "--use-precision-aware-optimizer": (
        "switch",
        "OptimizerConfig.use_precision_aware_optimizer",
    ),
    "--cpu-offloading": ("switch", "ModelParallelConfig.cpu_offloading"),
    "--cpu-offloading-num-layers": ("int", "ModelParallelConfig.cpu_offloading_num_layers"),
    # the rest of the model's shape (issue 31): TransformerConfig fields, whose flags Megatron-LM
    # 0.16 generates (ArgumentGroupFactory; --norm-epsilon is layernorm_epsilon's alias), and
    # Megatron-LM's own network-size arguments (megatron/training/arguments.py)
    "--kv-channels": ("int", "TransformerConfig.kv_channels"),
    "--norm-epsilon": ("float", "TransformerConfig.layernorm_epsilon (argparse alias)"),
    "--add-qkv-bias": ("switch", "TransformerConfig.add_qkv_bias"),
    "--qk-layernorm": ("switch", "TransformerConfig.qk_layernorm"),
    "--qk-l2-norm": ("switch", "TransformerConfig.qk_l2_norm"),
    "--window-size": ("str", "TransformerConfig.window_size (a tuple: left, right)"),
    "--window-attn-skip-freq": ("str", "TransformerConfig.window_attn_skip_freq"),
    "--softmax-type": ("str", "TransformerConfig.softmax_type (vanilla, off-by-one, learnable)"),
    "--moe-shared-expert-gate": ("switch", "TransformerConfig.moe_shared_expert_gate"),
    "--no-rope-freq": ("str", "TransformerConfig.no_rope_freq"),
    "--squared-relu": ("switch", "Megatron-LM arguments.py (activation_func = squared_relu)"),
    "--make-vocab-size-divisible-by": ("int", "Megatron-LM arguments.py (vocabulary padding)"),
    "--rotary-base": ("int", "Megatron-LM arguments.py -> GPTModel(rotary_base=...)"),
    "--rotary-percent": ("float", "Megatron-LM arguments.py -> GPTModel(rotary_percent=...)"),
    "--use-rope-scaling": ("switch", "Megatron-LM arguments.py -> GPTModel(rope_scaling=...)"),
    "--rope-scaling-factor": ("float", "Megatron-LM arguments.py (Llama 3.1 scaling factor)"),
    "--rope-type": ("str", "MLATransformerConfig.rope_type (rope, yarn)"),
    "--rotary-scaling-factor": ("float", "MLATransformerConfig.rotary_scaling_factor"),
    "--mscale": ("float", "MLATransformerConfig.mscale"),
    "--mscale-all-dim": ("float", "MLATransformerConfig.mscale_all_dim"),
    # hybrid models (issue 33): Megatron-Core's MambaModel (megatron/core/models/mamba,
    # megatron/core/ssm) through Megatron-LM's pretrain_mamba.py (mamba_builders.py
    # mamba_builder: MambaModel(hybrid_override_pattern=args.hybrid_override_pattern, ...),
    # the layer spec by --spec), and GPTModel's Gated DeltaNet attention variant
    "--hybrid-override-pattern": ("str", "MambaModel(hybrid_override_pattern=...)"),
    "--spec": ("list", "Megatron-LM mamba_builders.py import_module(args.spec)"),
    "--mamba-state-dim": ("int", "TransformerConfig.mamba_state_dim"),
    "--mamba-head-dim": ("int", "TransformerConfig.mamba_head_dim"),
    "--mamba-num-groups": ("int", "TransformerConfig.mamba_num_groups"),
    "--mamba-num-heads": ("int", "TransformerConfig.mamba_num_heads"),
    "--experimental-attention-variant": (
        "str",
        "TransformerConfig.experimental_attention_variant (gated_delta_net)",
    ),
    "--linear-attention-freq": ("str", "TransformerConfig.linear_attention_freq (int or list)"),
    "--linear-conv-kernel-dim": ("int", "TransformerConfig.linear_conv_kernel_dim"),
    "--linear-key-head-dim": ("int", "TransformerConfig.linear_key_head_dim"),
    "--linear-value-head-dim": ("int", "TransformerConfig.linear_value_head_dim"),
    "--linear-num-key-heads": ("int", "TransformerConfig.linear_num_key_heads"),
    "--linear-num-value-heads": ("int", "TransformerConfig.linear_num_value_heads"),
    "--attention-output-gate": ("switch", "TransformerConfig.attention_output_gate"),
}
# The stack spec pretrain_mamba.py builds a hybrid from (megatron-core 0.16
# models/mamba/mamba_layer_specs.py: TransformerEngine layers, Mamba-2 mixers)
MAMBA_SPEC = "megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec"

# Load balancing: ours -> (Megatron's type, coefficient, expert bias). The coefficients are the
# published ones, not part of a ModelSpec: 1e-3 is the router_aux_loss_coef of Mixtral's and
# Qwen3-MoE's Hugging Face configs; DeepSeek-V3's auxiliary-loss-free balancing keeps a
# sequence-wise loss of alpha = 1e-4 (DeepSeek-V3 report, sec. 2.1.2; Megatron-Bridge
# DeepSeekV3 provider: seq_aux_loss, 1e-4, moe_router_enable_expert_bias).
_BALANCING = {
    "aux_loss": ("aux_loss", 1e-3, False),
    "aux_loss_free": ("seq_aux_loss", 1e-4, True),
    "none": ("none", 0.0, False),
}


class MegatronExporter(Exporter):
    """Command-line flags of Megatron-LM's `pretrain_gpt.py`, with the model's shape when a
    ModelSpec is given, and the `torchrun` launch line when a Cluster is given.

    Megatron derives dp = WORLD_SIZE / (tp * pp) and the gradient accumulation from the global and
    micro-batch sizes; it runs 1F1B, interleaved when virtual stages are given (Narayanan et al.
    2021).
    """

    name = "megatron"

    def export(self, strategy, *, model=None, cluster=None) -> Exported:
        s = strategy
        flags: list[str] = []
        notes: list[str] = []
        fields = FieldMap()
        if model is not None:
            model_part, fields, notes = model_flags(model, tp=s.tp)
            flags += model_part
            if model.moe is not None:
                notes.append(
                    "--moe-aux-loss-coeff is the published coefficient of this balancing "
                    "(autosearch does not model it); set your own"
                )
            notes.append(
                "vocabulary: NullTokenizer has vocab-size + 1 tokens (it appends an "
                "end-of-document token), so --vocab-size is one less than the model's; with "
                "your tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH) "
                "Megatron pads its size to a multiple of --make-vocab-size-divisible-by x tp"
            )
        else:
            notes.append("pass --model to add the model's flags (layers, hidden size, heads, ...)")
        flags += [
            f"--tensor-model-parallel-size {s.tp}",
            f"--pipeline-model-parallel-size {s.pp}",
        ]
        if s.cp > 1:
            flags.append(f"--context-parallel-size {s.cp}")
        flags += [
            f"--micro-batch-size {s.micro_batch_size}",
            f"--global-batch-size {s.global_batch_size}",
        ]
        notes.append(
            f"dp = WORLD_SIZE / (tp*pp*cp) = {s.dp}: launch {s.world_size} processes "
            "(torchrun --nnodes N --nproc-per-node GPUS_PER_NODE)"
        )
        unsupported = []
        mapped = {"dp", "tp", "pp", "cp", "micro_batch_size", "global_batch_size"}
        if s.pp > 1 and s.pipeline_schedule == "gpipe":
            unsupported.append(
                (
                    "pipeline_schedule",
                    "Megatron-LM has no GPipe schedule; 1F1B (same bubble, "
                    "less activation memory) is used instead",
                )
            )
        else:
            mapped.add("pipeline_schedule")
        chunks = s.layers_per_chunk(model.n_layers) if model is not None else None
        if model is not None and chunks is not None and program_of(model) == MAMBA_PROGRAM:
            chunks = _megatron_layers(model, chunks)
            if len(set(chunks)) > 1 or s.virtual_stages > 1:
                unsupported.append(
                    (
                        "pipeline_split",
                        f"MambaModel splits its {sum(chunks)} Megatron layers (one per symbol "
                        f"of the hybrid pattern) evenly over pp; the planned split is "
                        f"{list(chunks)} of them",
                    )
                )
                chunks = None
        if chunks is None or (len(set(chunks)) == 1 and chunks[0] > 0):  # the even split
            if s.virtual_stages > 1 and chunks is not None:
                flags.append(f"--num-layers-per-virtual-pipeline-stage {chunks[0]}")
            elif s.virtual_stages > 1:
                flags.append(f"--num-virtual-stages-per-pipeline-rank {s.virtual_stages}")
                notes.append(
                    "older Megatron-LM releases take --num-layers-per-virtual-pipeline-stage "
                    "n_layers/(pp*virtual_stages) instead (pass --model to get it)"
                )
        elif s.virtual_stages == 1 and len(set(chunks[1:-1])) <= 1 and min(chunks) > 0:
            middle = next(iter(set(chunks[1:-1])), None)  # first and last given, the rest even
            if chunks[0] != middle:
                flags.append(f"--decoder-first-pipeline-num-layers {chunks[0]}")
            if chunks[-1] != middle:
                flags.append(f"--decoder-last-pipeline-num-layers {chunks[-1]}")
        else:  # any other split, empty chunks included: Megatron-Core's custom layout (0.13+)
            assert model is not None
            flags.append(f"--pipeline-model-parallel-layout {layout(chunks, model.mtp_layers)}")
            notes.append(
                "--pipeline-model-parallel-layout needs megatron-core >= 0.13 (June 2025);"
                " it sets the virtual stages too"
            )
        mapped.update(("virtual_stages", "pipeline_split"))
        if s.sequence_parallel:
            flags.append("--sequence-parallel")
        mapped.add("sequence_parallel")
        modules = [] if s.recompute_modules == "none" else s.recompute_modules.split("+")
        if s.recompute in ("selective", "selective_op") or (modules and s.recompute == "none"):
            flags.append("--recompute-granularity selective")
            if modules:  # a module list replaces Megatron's default [core_attn]
                core = ["core_attn"] if s.recompute == "selective" else []
                flags.append("--recompute-modules " + " ".join(core + modules))
        elif s.recompute == "full" and s.recompute_num_layers is not None:
            flags += [
                "--recompute-granularity full",
                "--recompute-method block",
                f"--recompute-num-layers {s.recompute_num_layers}",
            ]
        elif s.recompute == "full":
            flags += [
                "--recompute-granularity full",
                "--recompute-method uniform",
                "--recompute-num-layers 1",
            ]
        mapped.add("recompute_num_layers")
        if modules and s.recompute in ("full", "selective_op"):
            unsupported.append(
                (
                    "recompute_modules",
                    f"Megatron takes --recompute-modules with selective granularity only; "
                    f"recompute={s.recompute} already recomputes them",
                )
            )
        else:
            mapped.add("recompute_modules")
        if s.recompute == "selective_op":
            unsupported.append(
                (
                    "recompute",
                    "op-level selective recompute (save matmul outputs) is torchtitan's; "
                    "Megatron's selective recompute is the attention core",
                )
            )
        else:
            mapped.add("recompute")
        if s.zero_stage == 1:
            flags.append("--use-distributed-optimizer")
            mapped.add("zero_stage")
        elif s.zero_stage == 2:
            flags.append("--use-distributed-optimizer")
            unsupported.append(
                (
                    "zero_stage",
                    "ZeRO-2: the distributed optimizer shards optimizer states and "
                    "reduce-scatters gradients, but keeps the full gradient buffer",
                )
            )
        elif s.zero_stage == 3:
            flags.append("--use-torch-fsdp2")
            unsupported.append(
                (
                    "zero_stage",
                    "ZeRO-3 runs through PyTorch FSDP2 (--use-torch-fsdp2), not Megatron's "
                    "own data-parallel code; check that your Megatron-LM version has it",
                )
            )
        else:
            mapped.add("zero_stage")
        if s.amp in ("bf16", "fp16"):
            flags.append(f"--{s.amp}")
        mapped.add("amp")
        if s.offload_optimizer:  # HybridDeviceOptimizer: the whole optimizer on the host
            flags += [
                "--optimizer-cpu-offload",
                "--optimizer-offload-fraction 1.0",
                "--overlap-cpu-optimizer-d2h-h2d",
                "--use-precision-aware-optimizer",
            ]
            if s.zero_stage == 0:
                notes.append(
                    "offload_optimizer: Megatron offloads the distributed optimizer's shard; "
                    "add --use-distributed-optimizer if your version asks for it"
                )
        mapped.add("offload_optimizer")
        if s.offload_activations == "layers" and (s.pp > 1 or s.recompute != "none"):
            # megatron-core 0.16 TransformerConfig.__post_init__ refuses both
            unsupported.append(
                (
                    "offload_activations",
                    "Megatron's layer offload (--cpu-offloading) runs without pipeline "
                    "parallelism and without recompute; its fine-grained offload "
                    "(--fine-grained-activation-offloading --offload-modules) offloads module "
                    "inputs, not whole layers",
                )
            )
        elif s.offload_activations == "layers":
            # TransformerEngine's CPU offload of every layer but the last (megatron-core
            # asserts cpu_offloading_num_layers < num_layers)
            if model is not None:
                flags += ["--cpu-offloading", f"--cpu-offloading-num-layers {model.n_layers - 1}"]
                mapped.add("offload_activations")
            else:
                unsupported.append(
                    (
                        "offload_activations",
                        "--cpu-offloading-num-layers needs the model's layer count (export "
                        "with a model)",
                    )
                )
        else:
            mapped.add("offload_activations")
        keys, declared, cannot = declared_mappings(self.name, s)
        flags += [f"{flag} {value}" for flag, value in keys.items()]
        mapped |= declared
        unsupported += cannot
        if s.fp8 != "none":
            flags += ["--fp8-format hybrid", "--fp8-recipe tensorwise"]
            notes.append(
                "fp8 runs through TransformerEngine (--transformer-impl transformer_engine)"
            )
        if s.fp8 == "rowwise":
            unsupported.append(
                (
                    "fp8",
                    "Megatron's fp8 recipes are tensorwise, delayed, mxfp8 and blockwise; "
                    "torchao's rowwise scaling is not one of them (tensorwise given)",
                )
            )
        else:
            mapped.add("fp8")
        if s.compile:
            unsupported.append(
                (
                    "compile",
                    "Megatron-LM fuses elementwise work with TransformerEngine and its own "
                    "kernels, not torch.compile",
                )
            )
        else:
            mapped.add("compile")
        if s.async_tp:
            flags.append("--tp-comm-overlap")
            notes.append("--tp-comm-overlap needs TransformerEngine's userbuffers")
        mapped.add("async_tp")
        program = program_of(model)
        launcher = [program]
        if cluster is not None:
            launcher = [
                f"torchrun --nnodes {cluster.n_nodes} --nproc-per-node {cluster.gpus_per_node}",
                program,
            ]
            if cluster.world_size != s.world_size:
                notes.append(
                    f"the cluster has {cluster.world_size} devices but dp*tp*pp = {s.world_size}"
                )
        # Every word quoted for the shell (they are numbers and fixed names; quoting keeps it so).
        text = " \\\n  ".join(shell_words(x.split()) for x in [" ".join(launcher)] + flags)
        return Exported(
            self.name,
            text,
            frozenset(mapped),
            tuple(unsupported),
            tuple(notes),
            filename="megatron.sh",
            model_fields=tuple(fields.exported.items()),
            refused=tuple(fields.refused.items()),
            script=launch_script(flags, s, model=model, cluster=cluster, refused=fields.refused),
        )


def launch_script(flags, strategy, *, model=None, cluster=None, refused=None) -> str:
    """megatron.sh: Megatron-LM's pretrain_gpt.py under torchrun's c10d rendezvous, with the
    data, tokenizer, iterations, learning rate and checkpoint folder as placeholders;
    MOCK_DATA=1 trains on Megatron's mock dataset (--mock-data) with the NullTokenizer."""
    nodes, per_node = (
        (1, strategy.world_size) if cluster is None else (cluster.n_nodes, cluster.gpus_per_node)
    )
    what = f"{model.name} " if model is not None else ""
    setup = [
        require(
            "MEGATRON_LM",
            f"set MEGATRON_LM to your Megatron-LM checkout, the folder with {program_of(model)}",
        ),
        require("TRAIN_ITERS", PLACEHOLDERS["TRAIN_ITERS"]),
        require("LR", PLACEHOLDERS["LR"]),
        require("CHECKPOINT_DIR", PLACEHOLDERS["CHECKPOINT_DIR"]),
        'if [ "${MOCK_DATA:-0}" = 1 ]; then  # smoke run: Megatron\'s mock dataset',
        "    DATA=(--mock-data)",
        "else",
        "    "
        + require(
            "DATA_PATH",
            PLACEHOLDERS["DATA_PATH"].format(
                data="a Megatron indexed dataset prefix, the path without .bin or .idx"
            ),
        ),
        "    "
        + require(
            "TOKENIZER",
            PLACEHOLDERS["TOKENIZER"].format(tokenizer="a Hugging Face tokenizer name or folder"),
        ),
        '    DATA=(--data-path "$DATA_PATH" --split 99,1,0'
        ' --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")',
        "fi",
    ]
    guard = ""
    if refused:
        guard = refusal("Megatron-LM", model.name if model else "the model", refused.items())
        guard += "; run with ALLOW_UNSUPPORTED=1 to train it anyway"
    return script(
        title=f"Megatron-LM {program_of(model)} for {what}with {strategy.short()}, by autosearch",
        comments=[
            "Smoke run on mock data: MOCK_DATA=1 TRAIN_ITERS=10 LR=3e-4 "
            "CHECKPOINT_DIR=/tmp/ckpt MEGATRON_LM=/path/to/Megatron-LM bash megatron.sh",
            "Several nodes: run it on each (srun --ntasks-per-node 1 bash megatron.sh), or set "
            "MASTER_ADDR to the first node on each.",
        ],
        nnodes=nodes,
        gpus_per_node=per_node,
        setup=setup,
        program=[f'"$MEGATRON_LM/{program_of(model)}"'],
        args=flags,
        tail=[
            '"${DATA[@]}"',
            '--train-iters "$TRAIN_ITERS" --lr "$LR"',
            '--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"',
        ],
        guard=guard,
    )


def model_flags(model, arch=None, *, tp: int = 1) -> tuple[list[str], FieldMap, list[str]]:
    """The flags that give Megatron-LM the shape of `model` with the published settings `arch`
    (`architecture_of`), what each model field became, and notes. Every flag is a field of
    Megatron-Core's TransformerConfig (Megatron-LM 0.16 generates ``--field-name`` from each,
    `megatron/training/arguments.py` ArgumentGroupFactory) or one of Megatron-LM's own."""
    from autosearch.export._architecture import ARCH_FIELDS, MODEL_FIELDS, padded_vocab

    arch = arch if arch is not None else architecture_of(model)
    m = FieldMap()
    notes: list[str] = []
    mamba_model = program_of(model) == MAMBA_PROGRAM
    # MambaModel counts a Megatron layer per symbol of the pattern (a mixer, or an MLP)
    n_layers = len(model.pattern) if mamba_model else model.n_layers
    flags = [
        f"--num-layers {n_layers}",
        f"--hidden-size {model.hidden_size}",
        f"--num-attention-heads {model.n_heads}",
    ]
    m.set(("n_layers", "hidden_size", "n_heads"), " ".join(flags))
    if model.n_kv_heads != model.n_heads:
        flags += ["--group-query-attention", f"--num-query-groups {model.n_kv_heads}"]
    m.set("n_kv_heads", f"--num-query-groups {model.n_kv_heads}")
    if model.mla is None:  # MLA's heads are its own (--qk-head-dim, --v-head-dim)
        flags.append(f"--kv-channels {model.head_dim}")
        m.set("head_dim", f"--kv-channels {model.head_dim}")
    else:
        m.set("head_dim", "MLA: --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim")
    flags.append(f"--ffn-hidden-size {model.ffn_hidden_size}")
    m.set("ffn_hidden_size", f"--ffn-hidden-size {model.ffn_hidden_size}")
    activation = {"swiglu": ["--swiglu"], "relu2": ["--squared-relu"], "gelu": []}
    if model.ffn_activation in activation:
        flags += activation[model.ffn_activation]
        m.set("ffn_activation", " ".join(activation[model.ffn_activation]) or "gelu (default)")
    else:
        m.refuse(
            "ffn_activation",
            f"{model.ffn_activation}: Megatron-LM's gated MLPs are --swiglu (SiLU) and "
            "--quick-geglu (x * sigmoid(1.702 x)), not GeGLU's tanh GELU",
        )
    flags += [f"--seq-length {model.seq_len}", f"--max-position-embeddings {model.seq_len}"]
    m.set("seq_len", f"--seq-length {model.seq_len}")
    # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x tp
    # (Megatron-LM training/tokenizer `_vocab_size_with_padding`); 128 is its default.
    padded = padded_vocab(model.vocab_size, 128 * tp)
    flags += [
        "--tokenizer-type NullTokenizer",  # it appends an end-of-document token: V - 1 gives V
        f"--vocab-size {model.vocab_size - 1}",
        "--make-vocab-size-divisible-by 128",
    ]
    m.set("vocab_size", f"--vocab-size {model.vocab_size} --make-vocab-size-divisible-by 128")
    if padded != model.vocab_size:
        notes.append(
            f"Megatron pads the vocabulary of {model.vocab_size} to {padded} (a multiple of "
            f"128 x tp = {128 * tp}): {padded - model.vocab_size} unused rows, "
            f"{(padded - model.vocab_size) * model.hidden_size:,} parameters per embedding "
            "matrix more than planned"
        )
    if model.is_gpt_style:
        flags.append("--normalization LayerNorm")
    else:
        flags.append("--normalization RMSNorm")
    flags.append(f"--norm-epsilon {arch.norm_eps:g}")
    m.set("arch.norm_eps", f"--norm-epsilon {arch.norm_eps:g}")
    position = _POSITIONS.get(model.position_embedding)
    if arch.nope:  # GPTModel / MambaModel position_embedding_type "none"
        m.set("arch.nope", "--position-embedding-type none")
        m.set("position_embedding", "--position-embedding-type none (arch.nope)")
        position = "none"
    elif position is None:
        m.refuse("position_embedding", f"{model.position_embedding}: Megatron-LM has no ALiBi")
        position = "rope"
    else:
        m.set("position_embedding", f"--position-embedding-type {position}")
    flags.append(f"--position-embedding-type {position}")
    if position != "none":
        flags += _rope_flags(model, arch, m, notes)
    else:
        m.set(("arch.rope_base", "arch.rope_scaling", "arch.rotary_percent"), "no RoPE")
    if not model.linear_bias:
        flags.append("--disable-bias-linear")
    m.set("linear_bias", "--disable-bias-linear" if not model.linear_bias else "biases (default)")
    if arch.qkv_bias:
        flags.append("--add-qkv-bias")
    m.set("arch.qkv_bias", "--add-qkv-bias" if arch.qkv_bias else "off (default)")
    if not model.dropout:
        flags += ["--hidden-dropout 0.0", "--attention-dropout 0.0"]
    m.set(
        "dropout", "--hidden-dropout 0.0 --attention-dropout 0.0" if not model.dropout else "0.1"
    )
    if not model.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    m.set(
        "tied_embeddings",
        "tied (default)" if model.tied_embeddings else "--untie-embeddings-and-output-weights",
    )
    if arch.qk_norm == "rmsnorm":
        flags.append("--qk-layernorm")  # the --normalization kind, on each head's q and k
        m.set("arch.qk_norm", "--qk-layernorm")
    elif arch.qk_norm == "l2":
        flags.append("--qk-l2-norm")
        m.set("arch.qk_norm", "--qk-l2-norm")
    else:
        m.set("arch.qk_norm", "off (default)")
    if model.sliding_layers:
        # TransformerConfig.window_size (left, right): Megatron-Bridge's gpt-oss and Gemma
        # providers give (window, 0); window_attn_skip_freq p: every p-th layer attends fully
        flags.append(f"--window-size ({model.sliding_window},0)")
        m.set("sliding_window", f"--window-size ({model.sliding_window},0)")
        if model.sliding_window_pattern:
            flags.append(f"--window-attn-skip-freq {model.sliding_window_pattern}")
        m.set("sliding_window_pattern", f"--window-attn-skip-freq {model.sliding_window_pattern}")
        notes.append("sliding-window attention runs in TransformerEngine's or flash attention")
    else:
        m.set(("sliding_window", "sliding_window_pattern"), "full attention (default)")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(model, name) is not None:
            m.refuse(name, "TransformerConfig has no logit soft-capping")
        else:
            m.set(name, "none (default)")
    if arch.post_norms:
        m.refuse("arch.post_norms", "GPTModel's blocks have no norms after attention and MLP")
    if arch.attention_chunk is not None:
        m.refuse("arch.attention_chunk", "Megatron-LM has no chunked (local-block) attention")
    if arch.attention_sinks:
        flags.append("--softmax-type learnable")
        m.set("arch.attention_sinks", "--softmax-type learnable")
    if arch.swiglu_limit is not None:
        m.refuse(
            "arch.swiglu_limit",
            "activation_func_clamp_value clamps quick-GELU only, not --swiglu",
        )
    if arch.shared_expert_gate:
        flags.append("--moe-shared-expert-gate")
        m.set("arch.shared_expert_gate", "--moe-shared-expert-gate")
    if model.mla is not None:
        mla = model.mla
        flags.append("--multi-latent-attention")
        if mla.q_lora_rank is not None:
            flags.append(f"--q-lora-rank {mla.q_lora_rank}")
        flags += [
            f"--kv-lora-rank {mla.kv_lora_rank}",
            f"--qk-head-dim {mla.qk_nope_head_dim}",
            f"--qk-pos-emb-head-dim {mla.qk_rope_head_dim}",
            f"--v-head-dim {mla.v_head_dim}",
        ]
        for name, flag in (
            ("q_lora_rank", "--q-lora-rank"),
            ("kv_lora_rank", "--kv-lora-rank"),
            ("qk_nope_head_dim", "--qk-head-dim"),
            ("qk_rope_head_dim", "--qk-pos-emb-head-dim"),
            ("v_head_dim", "--v-head-dim"),
        ):
            m.set(f"mla.{name}", f"{flag} {getattr(mla, name)}")
    else:
        m.set([x for x in MODEL_FIELDS if x.startswith("mla.")], "no MLA (default)")
    if model.moe is not None:
        flags += moe_flags(model, placed=not mamba_model)
        m.set([x for x in MODEL_FIELDS if x.startswith("moe.")], "--num-experts ... (MoE flags)")
    else:
        m.set([x for x in MODEL_FIELDS if x.startswith("moe.")], "dense MLP (default)")
    if model.mtp_layers:  # multi-token prediction modules, on the last pipeline stage
        flags.append(f"--mtp-num-layers {model.mtp_layers}")
    m.set("mtp_layers", f"--mtp-num-layers {model.mtp_layers}" if model.mtp_layers else "none")
    if model.lora is not None:
        m.refuse(
            "lora",
            "pretrain_gpt.py trains every weight; LoRA is Megatron-Bridge's PEFT "
            "(megatron.bridge.peft.lora.LoRA), not a Megatron-LM flag",
        )
    else:
        m.set("lora", "full training")
    flags += _hybrid_flags(model, m, notes)
    if model.attention_output_gate:
        flags.append("--attention-output-gate")
        m.set("attention_output_gate", "--attention-output-gate")
    else:
        m.set("attention_output_gate", "off (default)")
    for name in ARCH_FIELDS:  # the rest, at their off values
        if name not in m.exported and name not in m.refused:
            m.set(name, "off (default)")
    if not arch.known:
        notes.append(
            f"{model.name} is not a catalog model: its RoPE base, norm epsilon and QK norm "
            "are not in its ModelSpec, so Megatron's defaults are given (--rotary-base 10000, "
            "--norm-epsilon 1e-5, no QK norm); set your model's"
        )
    return flags, m, notes


def _rope_flags(model, arch, m: FieldMap, notes: list[str]) -> list[str]:
    """RoPE's base, scaling, share of channels and the layers without it."""
    if model.position_embedding != "rotary":
        m.set(("arch.rope_base", "arch.rope_scaling", "arch.rotary_percent"), "no RoPE")
        if arch.nope_layer_step:
            m.refuse("arch.nope_layer_step", "RoPE is off: no NoPE layers to give")
        return []
    base = arch.rope_base if arch.rope_base is not None else 10000
    flags = [f"--rotary-base {base:.0f}"]  # an int in Megatron-LM (type=int)
    m.set("arch.rope_base", f"--rotary-base {base:.0f}")
    if arch.rotary_percent != 1.0:
        flags.append(f"--rotary-percent {arch.rotary_percent:g}")
    m.set("arch.rotary_percent", f"--rotary-percent {arch.rotary_percent:g}")
    scaling = arch.scaling
    kind = scaling.get("type")
    if kind == "llama3" and {k: v for k, v in scaling.items() if k not in ("type", "factor")} == {
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }:
        # GPTModel(rope_scaling=True): Llama 3.1's scaling with low 1, high 4, 8192 built in
        # (megatron/core/models/common/embeddings/rotary_pos_embedding.py _apply_scaling)
        flags += ["--use-rope-scaling", f"--rope-scaling-factor {scaling['factor']:g}"]
        m.set(
            "arch.rope_scaling", f"--use-rope-scaling --rope-scaling-factor {scaling['factor']:g}"
        )
    elif kind == "yarn" and model.mla is not None:
        # MLATransformerConfig: rope_type yarn with rotary_scaling_factor, mscale,
        # mscale_all_dim; beta_fast 32, beta_slow 1 and 4096 original positions are its defaults
        rest = {
            k: scaling[k] for k in ("original_max_position_embeddings", "beta_fast", "beta_slow")
        }
        if rest != {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}:
            m.refuse("arch.rope_scaling", f"YaRN with {rest}: Megatron-LM sets 4096, 32, 1 only")
        else:
            flags += [
                "--rope-type yarn",
                f"--rotary-scaling-factor {scaling['factor']:g}",
                f"--mscale {scaling['mscale']:g}",
                f"--mscale-all-dim {scaling['mscale_all_dim']:g}",
            ]
            m.set("arch.rope_scaling", "--rope-type yarn --rotary-scaling-factor ...")
    elif kind is not None:
        m.refuse(
            "arch.rope_scaling",
            f"{kind} RoPE scaling {scaling}: Megatron-LM's GPTModel has Llama 3.1's (factor; "
            "low 1, high 4, 8192) and YaRN for multi-latent attention only",
        )
    else:
        m.set("arch.rope_scaling", "none (default)")
    if arch.nope_layer_step:
        flags.append(f"--no-rope-freq {arch.nope_layer_step}")
        m.set("arch.nope_layer_step", f"--no-rope-freq {arch.nope_layer_step}")
    return flags


def moe_flags(model, *, placed: bool = True) -> list[str]:
    """Megatron-Core's MoE layer for `model.moe`: routed experts as grouped GEMMs behind the
    all-to-all dispatcher (what autosearch prices), the shared experts as one MLP of their
    summed width, the MoE layers as an explicit 0/1 list (`ModelSpec.moe_layers`; not
    `placed`: the hybrid pattern's ``E`` places them), the router's score function and load
    balancing."""
    moe = model.moe
    kind, coeff, bias = _BALANCING[moe.load_balancing]
    flags = [
        f"--num-experts {moe.n_experts}",
        f"--moe-router-topk {moe.top_k}",
        f"--moe-ffn-hidden-size {moe.ffn_hidden_size}",
    ]
    if moe.n_shared_experts:
        width = moe.n_shared_experts * moe.shared_ffn_hidden_size
        flags.append(f"--moe-shared-expert-intermediate-size {width}")
    if placed and not all(model.moe_layers):
        flags.append(f"--moe-layer-freq {_layer_pattern(model.moe_layers)}")
    flags += [
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type alltoall",
        f"--moe-router-score-function {moe.router}",
        f"--moe-router-load-balancing-type {kind}",
        f"--moe-aux-loss-coeff {coeff:g}",
    ]
    if bias:
        flags.append("--moe-router-enable-expert-bias")
    if moe.capacity_factor is not None:
        flags.append(f"--moe-expert-capacity-factor {moe.capacity_factor:g}")
    return flags


def _layer_pattern(layers: tuple[bool, ...]) -> str:
    """Megatron-LM's list form of --moe-layer-freq (a Python expression it evaluates,
    `moe_freq_type`): a repeated period ``([0,1]*24)``, else run-length coded
    ``([0]*3+[1]*58)``."""
    flags = list(map(int, layers))
    for p in range(2, len(flags) // 2 + 1):
        if len(flags) % p == 0 and flags == flags[:p] * (len(flags) // p):
            return f"([{','.join(map(str, flags[:p]))}]*{len(flags) // p})"
    runs: list[list[int]] = []
    for flag in flags:
        if runs and runs[-1][0] == flag:
            runs[-1][1] += 1
        else:
            runs.append([flag, 1])
    return "(" + "+".join(f"[{f}]*{n}" for f, n in runs) + ")"


# ModelSpec.position_embedding -> GPTModel(position_embedding_type=...); Megatron has no ALiBi.
_POSITIONS = {"learned": "learned_absolute", "rotary": "rope"}


def layout(chunks: tuple[int, ...], mtp_layers: int = 0) -> str:
    """Megatron-Core's --pipeline-model-parallel-layout of layers per chunk (megatron-core
    transformer/pipeline_parallel_layer_layout.py): the chunks in pipeline order split by "|",
    "t" a decoder layer, "E" the embedding (first), "m" a multi-token prediction module and "L"
    the loss (last); "t*4" four layers, "(t*4|)*14" fourteen such chunks. For 61 layers over
    pp16 with one MTP module: "Et*4|(t*4|)*14t*1mL"."""
    parts = [f"t*{n}" if n else "" for n in chunks]
    parts[0] = "E" + parts[0]
    parts[-1] += "m" * mtp_layers + "L"
    if len(parts) <= 2:
        return "|".join(parts)
    runs = ((part, len(list(same))) for part, same in itertools.groupby(parts[1:-1]))
    body = "".join(f"({part}|)*{n}" if n > 1 else f"{part}|" for part, n in runs)
    return f"{parts[0]}|{body}{parts[-1]}"


GPT_PROGRAM, MAMBA_PROGRAM = "pretrain_gpt.py", "pretrain_mamba.py"


def program_of(model) -> str:
    """The Megatron-LM script that builds `model`: pretrain_mamba.py (Megatron-Core's
    MambaModel, whose layers are the symbols of the hybrid pattern) for a model with Mamba-2
    mixers or with a mixer or an MLP alone in a block; pretrain_gpt.py (GPTModel: attention,
    or its Gated DeltaNet variant, and an MLP in every layer) otherwise."""
    if model is None:
        return GPT_PROGRAM
    alone = any(layer.mixer == "none" or layer.mlp == "none" for layer in model.layers)
    return MAMBA_PROGRAM if model.mamba is not None or alone else GPT_PROGRAM


def _megatron_layers(model, chunks: tuple[int, ...]) -> tuple[int, ...]:
    """Megatron layers (symbols of the hybrid pattern) in each pipeline chunk of `chunks`
    blocks."""
    out, start = [], 0
    for n in chunks:
        out.append(sum(len(layer.symbols) for layer in model.layers[start : start + n]))
        start += n
    return tuple(out)


def _hybrid_flags(model, m: FieldMap, notes: list[str]) -> list[str]:
    """The layer pattern and the Mamba-2 / Gated DeltaNet mixers.

    Mamba-2 (and blocks of a mixer or an MLP alone): MambaModel by pretrain_mamba.py,
    ``--hybrid-override-pattern`` in Megatron's symbols (``M``, ``*``, ``-``, ``E``: megatron-core
    0.16 ``ssm/mamba_hybrid_layer_allocation.py`` ``Symbols``), one Megatron layer each, the
    mixer's ``--mamba-*`` fields (MambaMixer reads mamba_state_dim, mamba_head_dim,
    mamba_num_groups, mamba_num_heads from the config; its conv1d has 4 taps and a bias and
    its projections no bias, fixed in ``mamba_mixer.py``). Gated DeltaNet: GPTModel's
    ``experimental_attention_variant`` gated_delta_net, the layers by ``linear_attention_freq``
    (1 a Gated DeltaNet layer, 0 attention: ``get_linear_attention_pattern``) and the
    ``linear_*`` fields; megatron-core 0.16's hybrid pattern has no symbol for it."""
    flags: list[str] = []
    blocks = model.layers
    m.set("mamba1", "no Mamba-1 layers")
    if model.mamba1 is not None:
        why = (
            "megatron-core has no Mamba-1 layer (its MambaMixer is Mamba-2's SSD; megatron-core "
            "0.16 Symbols: M * - E)"
        )
        m.refuse("mamba1", why)
        m.refuse("layer_pattern", f"{model.pattern[:40]}: {why}")
        m.set(("mamba", "gdn"), "see layer_pattern")
        return flags
    if program_of(model) == GPT_PROGRAM:
        gdn = model.gdn
        if gdn is None:
            m.set("layer_pattern", "attention + MLP layers (--moe-layer-freq places the experts)")
        elif gdn.gate_rank is not None:
            why = (
                "megatron-core 0.16's GatedDeltaNet has one decay per head and a full output-"
                "gate projection; Kimi Delta Attention's per-channel low-rank gates are not in it"
            )
            m.refuse("gdn", why)
            m.refuse("layer_pattern", f"{model.pattern[:40]}: {why}")
        else:
            which = tuple(layer.mixer == "gdn" for layer in blocks)
            flags += [
                "--experimental-attention-variant gated_delta_net",
                f"--linear-attention-freq {_layer_pattern(which)}",
                f"--linear-conv-kernel-dim {gdn.conv_kernel}",
                f"--linear-key-head-dim {gdn.head_k_dim}",
                f"--linear-value-head-dim {gdn.head_v_dim}",
                f"--linear-num-key-heads {gdn.n_k_heads}",
                f"--linear-num-value-heads {gdn.n_v_heads}",
            ]
            m.set(
                "layer_pattern",
                f"--linear-attention-freq {_layer_pattern(which)} (--moe-layer-freq the experts)",
            )
            m.set("gdn", "--experimental-attention-variant gated_delta_net --linear-* ...")
            notes.append(
                "Gated DeltaNet layers: megatron-core >= 0.16 (megatron/core/ssm/"
                "gated_delta_net.py), with flash-linear-attention installed"
            )
        if gdn is None:
            m.set("gdn", "no Gated DeltaNet layers")
        m.set("mamba", "no Mamba-2 layers")
        return flags
    # MambaModel
    if any(layer.mixer == "attention+mamba" for layer in blocks):
        why = (
            "MambaModel's hybrid pattern has no symbol for attention and Mamba-2 in parallel in "
            "one layer (megatron-core 0.16 Symbols: M * - E; Falcon-H1's FalconH1DecoderLayer), "
            "and M* would be two layers with two norms and residuals"
        )
        m.refuse("layer_pattern", f"{model.pattern[:40]}: {why}")
        m.set("mamba", "see layer_pattern")
        m.set("gdn", "no Gated DeltaNet layers")
        return flags
    if model.gdn is not None:
        why = (
            "MambaModel's hybrid pattern has no Gated DeltaNet symbol (megatron-core 0.16 "
            "Symbols: M * - E) and GPTModel has no Mamba-2 layers"
        )
        m.refuse("gdn", why)
        m.refuse("layer_pattern", f"{model.pattern[:40]}: {why}")
        m.set("mamba", "see layer_pattern")
        return flags
    pattern = model.pattern
    flags += [f"--hybrid-override-pattern {pattern}", f"--spec {MAMBA_SPEC}"]
    m.set("layer_pattern", f"--hybrid-override-pattern {pattern[:40]}...")
    mamba = model.mamba
    if mamba is None:
        m.set("mamba", "no Mamba-2 layers")
    else:
        flags += [
            f"--mamba-state-dim {mamba.d_state}",
            f"--mamba-head-dim {mamba.head_dim}",
            f"--mamba-num-groups {mamba.n_groups}",
            f"--mamba-num-heads {mamba.n_heads}",
        ]
        fixed = {"conv_kernel": 4, "conv_bias": True, "proj_bias": False}
        other = {k: getattr(mamba, k) for k, v in fixed.items() if getattr(mamba, k) != v}
        if other:
            m.refuse(
                "mamba",
                f"{other}: megatron-core's MambaMixer has a 4-tap conv1d with a bias and "
                "projections without (mamba_mixer.py, not config fields)",
            )
        else:
            m.set("mamba", "--mamba-state-dim --mamba-head-dim --mamba-num-groups ...")
        if mamba.chunk_size != 128:
            notes.append(
                f"MambaMixer scans in chunks of 128 tokens (mamba_mixer.py chunk_size, not a "
                f"flag); the model plans {mamba.chunk_size}: the same network, another tiling"
            )
        width = 2 * mamba.d_inner + 2 * mamba.n_groups * mamba.d_state + mamba.n_heads
        if width % 16:
            notes.append(
                f"MambaMixer asserts its in_proj width (2 d_inner + 2 groups d_state + heads "
                f"= {width}) is a multiple of 16 for TransformerEngine; this one is not"
            )
    m.set("gdn", "no Gated DeltaNet layers")
    notes.append(
        "pretrain_mamba.py builds MambaModel: --num-layers counts each symbol of "
        "--hybrid-override-pattern as a Megatron layer (releases after megatron-core 0.16 name "
        "the flag --hybrid-layer-pattern)"
    )
    return flags
