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

from autosearch.export._base import Exported, Exporter, declared_mappings, shell_words

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
        "GPTModel(position_embedding_type=...) learned_absolute|rope",
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
        if model is not None:
            flags += model_flags(model)
            if model.position_embedding not in _POSITIONS:
                notes.append(
                    f"{model.name} uses {model.position_embedding} positions, which Megatron-LM "
                    "does not have; rope is given instead"
                )
            notes.append(
                "vocabulary: --tokenizer-type NullTokenizer --vocab-size sets the size only; "
                "for real text give your tokenizer (e.g. --tokenizer-type HuggingFaceTokenizer "
                "--tokenizer-model PATH), whose size Megatron pads to a multiple of "
                "--make-vocab-size-divisible-by x tp"
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
        if s.virtual_stages > 1:
            if chunks is not None:
                flags.append(f"--num-layers-per-virtual-pipeline-stage {chunks[0]}")
            else:
                flags.append(f"--num-virtual-stages-per-pipeline-rank {s.virtual_stages}")
                notes.append(
                    "older Megatron-LM releases take --num-layers-per-virtual-pipeline-stage "
                    "n_layers/(pp*virtual_stages) instead (pass --model to get it)"
                )
        mapped.add("virtual_stages")
        split_ok = chunks is None or len(set(chunks)) == 1
        if chunks is not None and not split_ok and s.virtual_stages == 1:
            middle = set(chunks[1:-1])
            if len(middle) <= 1:  # Megatron: first and last given, the rest split evenly
                even = next(iter(middle), None)
                if chunks[0] != even:
                    flags.append(f"--decoder-first-pipeline-num-layers {chunks[0]}")
                if chunks[-1] != even:
                    flags.append(f"--decoder-last-pipeline-num-layers {chunks[-1]}")
                split_ok = True
        if split_ok:
            mapped.add("pipeline_split")
        else:
            unsupported.append(
                (
                    "pipeline_split",
                    f"Megatron-LM splits layers evenly, with only the first and last pipeline "
                    f"stage allowed to differ (and not with virtual stages); {list(chunks or ())} "
                    "is not expressible",
                )
            )
        if s.sequence_parallel:
            flags.append("--sequence-parallel")
        mapped.add("sequence_parallel")
        if s.recompute in ("selective", "selective_op"):
            flags.append("--recompute-granularity selective")
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
        launcher = ["pretrain_gpt.py"]
        if cluster is not None:
            launcher = [
                f"torchrun --nnodes {cluster.n_nodes} --nproc-per-node {cluster.gpus_per_node}",
                "pretrain_gpt.py",
            ]
            if cluster.world_size != s.world_size:
                notes.append(
                    f"the cluster has {cluster.world_size} devices but dp*tp*pp = {s.world_size}"
                )
        # Every word quoted for the shell (they are numbers and fixed names; quoting keeps it so).
        text = " \\\n  ".join(shell_words(x.split()) for x in [" ".join(launcher)] + flags)
        return Exported(self.name, text, frozenset(mapped), tuple(unsupported), tuple(notes))


def model_flags(model) -> list[str]:
    """The flags that give Megatron-LM the shape of `model`: SwiGLU with RMSNorm (Llama style)
    or GeLU with LayerNorm (GPT style), the position embedding, biases and dropout as the spec
    says."""
    flags = [
        f"--num-layers {model.n_layers}",
        f"--hidden-size {model.hidden_size}",
        f"--num-attention-heads {model.n_heads}",
    ]
    if model.n_kv_heads != model.n_heads:
        flags += ["--group-query-attention", f"--num-query-groups {model.n_kv_heads}"]
    flags += [
        f"--ffn-hidden-size {model.ffn_hidden_size}",
        f"--seq-length {model.seq_len}",
        f"--max-position-embeddings {model.seq_len}",
        "--tokenizer-type NullTokenizer",
        f"--vocab-size {model.vocab_size}",
    ]
    if model.is_gpt_style:
        flags.append("--normalization LayerNorm")
    else:
        flags += ["--swiglu", "--normalization RMSNorm"]
    flags.append(f"--position-embedding-type {_POSITIONS.get(model.position_embedding, 'rope')}")
    if not model.linear_bias:
        flags.append("--disable-bias-linear")
    if not model.dropout:
        flags += ["--hidden-dropout 0.0", "--attention-dropout 0.0"]
    if not model.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    return flags


# ModelSpec.position_embedding -> GPTModel(position_embedding_type=...); Megatron has no ALiBi.
_POSITIONS = {"learned": "learned_absolute", "rotary": "rope"}
