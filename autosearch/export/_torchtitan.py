"""torchtitan: the job-config TOML of `torchtitan/train.py` (`--job.config_file job.toml`).

Every section and key was checked against torchtitan 0.2.2 `torchtitan/config/job_config.py`
(installed with `pip install --no-deps`, read, not imported): `JobConfig` has the sections
`model` (`Model.name`, `Model.flavor`), `training` (`Training.local_batch_size`,
`global_batch_size`, `seq_len`, `mixed_precision_param`), `parallelism` (`Parallelism.*`) and
`activation_checkpoint` (`ActivationCheckpoint.mode`, `selective_ac_option`). The gradient
accumulation is global_batch_size / (local_batch_size * dp) (`torchtitan/train.py`), and the
pipeline splits local_batch_size into micro-batches of pipeline_parallel_microbatch_size
(`torchtitan/distributed/pipeline_parallel.py`).

torchtitan 0.3 replaced TOML job files by Python config registries with command-line overrides:
the same `[section] key = value` pairs are given there as `--section.key value`
(`torchtitan/config/configs.py` keeps the `training` and `parallelism` names); its activation
checkpointing is chosen by config class instead of `mode`.
"""

from __future__ import annotations

from typing import Any

import tomli_w

from autosearch.export._base import Exported, Exporter, declared_mappings, shell_words

_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}

# section -> keys this exporter may write, all fields of torchtitan 0.2.2 job_config.py.
KEYS: dict[str, tuple[str, ...]] = {
    "model": ("name", "flavor", "converters"),
    "parallelism": (
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "fsdp_reshard_after_forward",
        "tensor_parallel_degree",
        "enable_async_tensor_parallel",
        "context_parallel_degree",
        "pipeline_parallel_degree",
        "pipeline_parallel_schedule",
        "pipeline_parallel_microbatch_size",
        "pipeline_parallel_layers_per_stage",
        "module_fqns_per_model_part",
        "expert_parallel_degree",  # Parallelism.expert_parallel_degree (MoE models)
        "expert_tensor_parallel_degree",  # 1 or tensor_parallel_degree only
    ),
    "training": ("local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param"),
    "activation_checkpoint": ("mode", "selective_ac_option"),
    "compile": ("enable", "components"),
    "quantize.linear.float8": ("recipe_name",),
}
# The class of each section in job_config.py (for the check against the installed package).
SECTION_CLASSES = {
    "model": "Model",
    "parallelism": "Parallelism",
    "training": "Training",
    "activation_checkpoint": "ActivationCheckpoint",
    "compile": "Compile",
    "quantize.linear.float8": "Float8Linear",
}

# torchtitan's Llama 3 flavors (torchtitan/models/llama3/__init__.py, llama3_args): dim, layers,
# heads, kv heads, and the MLP width its formula gives (multiple_of * ceil(multiplier * 8 dim/3
# / multiple_of), torchtitan/models/llama3/model/model.py FeedForward).
LLAMA3_FLAVORS = {
    "8B": (4096, 32, 32, 8, 14336),
    "70B": (8192, 80, 64, 8, 28672),
    "405B": (16384, 126, 128, 8, 53248),
}


class TorchTitanExporter(Exporter):
    """The `[model]`, `[parallelism]`, `[training]` and `[activation_checkpoint]` sections of a
    torchtitan job config. torchtitan composes FSDP2 (ZeRO-3 over `data_parallel_shard_degree`),
    DTensor tensor parallel (with sequence parallel on the norms always on) and
    torch.distributed.pipelining."""

    name = "torchtitan"

    def export(self, strategy, *, model=None, cluster=None) -> Exported:
        s = strategy
        unsupported, notes = [], []
        mapped = {
            "dp",
            "tp",
            "pp",
            "micro_batch_size",
            "global_batch_size",
            "pipeline_schedule",
            "virtual_stages",
        }
        doc: dict[str, Any] = {}  # section -> keys, written by tomli_w (no TOML by hand)
        if model is not None:
            flavor = llama3_flavor(model)
            if flavor is not None:
                doc["model"] = {"name": "llama3", "flavor": flavor}
                if s.fp8 != "none":
                    doc["model"]["converters"] = ["quantize.linear.float8"]
            else:
                notes.append(
                    f"no torchtitan model flavor has the shape of {model.name}: add one to "
                    "torchtitan/models/llama3/__init__.py (llama3_args) with "
                    f"dim={model.hidden_size}, n_layers={model.n_layers}, "
                    f"n_heads={model.n_heads}, n_kv_heads={model.n_kv_heads} and an MLP of "
                    f"{model.ffn_hidden_size}, and name it in [model] flavor"
                    + (
                        "; torchtitan's Llama blocks are SwiGLU/RMSNorm/RoPE, not GPT style"
                        if model.is_gpt_style
                        else ""
                    )
                )
            notes.append("the vocabulary comes from the tokenizer ([model] hf_assets_path)")
        shard, replicate = (s.dp, 1) if s.zero_stage >= 2 else (1, s.dp)
        par: dict[str, Any] = {
            "data_parallel_replicate_degree": replicate,
            "data_parallel_shard_degree": shard,
            "tensor_parallel_degree": s.tp,
        }
        doc["parallelism"] = par
        if s.async_tp:
            par["enable_async_tensor_parallel"] = True
            if not s.compile:
                notes.append("torchtitan's async tensor parallel needs [compile] enable = true")
        mapped.add("async_tp")
        if s.cp > 1:
            par["context_parallel_degree"] = s.cp
        mapped.add("cp")
        par["pipeline_parallel_degree"] = s.pp
        if s.pp > 1:
            par["pipeline_parallel_schedule"] = _SCHEDULES[s.pipeline_schedule]
            par["pipeline_parallel_microbatch_size"] = s.micro_batch_size
            chunks = s.layers_per_chunk(model.n_layers) if model is not None else None
            if chunks is not None and len(set(chunks)) > 1:
                par["module_fqns_per_model_part"] = module_fqns(chunks)
            elif chunks is not None and s.virtual_stages > 1:
                par["pipeline_parallel_layers_per_stage"] = chunks[0]
            elif s.virtual_stages > 1:
                notes.append(
                    "set pipeline_parallel_layers_per_stage = n_layers / "
                    f"{s.pp * s.virtual_stages} (pass --model to compute it)"
                )
        if s.pipeline_split is not None and model is None:
            unsupported.append(
                ("pipeline_split", "pass --model: the split names the model's layers")
            )
        else:
            mapped.add("pipeline_split")
        if s.zero_stage == 2:
            par["fsdp_reshard_after_forward"] = "never"
        elif s.zero_stage == 3:
            par["fsdp_reshard_after_forward"] = "always"
        if s.zero_stage == 1:
            unsupported.append(
                (
                    "zero_stage",
                    "FSDP2 has no ZeRO-1 (optimizer-only sharding); exported as plain "
                    "data parallel (replicate); ZeRO-2 is fsdp_reshard_after_forward=never",
                )
            )
        else:
            mapped.add("zero_stage")
        if s.tp > 1 and not s.sequence_parallel:
            unsupported.append(
                (
                    "sequence_parallel",
                    "torchtitan 0.2's tensor parallel always shards the norms over the tp "
                    "group (sequence parallel); 0.3 has parallelism.enable_sequence_parallel",
                )
            )
        else:
            mapped.add("sequence_parallel")
        # Without a pipeline, local_batch_size is the micro-batch and torchtitan accumulates
        # gradients global / (local * dp) times; with one, it is what each data-parallel rank
        # feeds the pipeline per step, split into micro-batches.
        local = s.micro_batch_size if s.pp == 1 else s.global_batch_size // s.dp
        training: dict[str, Any] = {
            "local_batch_size": local,
            "global_batch_size": s.global_batch_size,
        }
        doc["training"] = training
        if model is not None:
            training["seq_len"] = model.seq_len
        if s.amp in _DTYPES:
            training["mixed_precision_param"] = _DTYPES[s.amp]
            mapped.add("amp")
        else:
            training["mixed_precision_param"] = "bfloat16"
            unsupported.append(
                (
                    "amp",
                    "fp16 needs a gradient scaler, which torchtitan's FSDP2 mixed precision does "
                    "not set up; bfloat16 is exported instead",
                )
            )
        mode = {"selective_op": "selective"}.get(s.recompute, s.recompute)
        doc["activation_checkpoint"] = {"mode": mode}
        if mode == "selective":
            doc["activation_checkpoint"]["selective_ac_option"] = "op"
        if s.recompute == "selective":
            unsupported.append(
                (
                    "recompute",
                    "torchtitan has no attention-only recompute; its op-level selective AC "
                    "(save matmul outputs, recompute the rest) is given instead",
                )
            )
        else:
            mapped.add("recompute")
        if s.recompute_num_layers is not None:
            unsupported.append(
                (
                    "recompute_num_layers",
                    "torchtitan's selective_ac_option N checkpoints every N-th block, not the "
                    f"first {s.recompute_num_layers} of each stage; full AC is given instead",
                )
            )
        else:
            mapped.add("recompute_num_layers")
        if s.compile:
            doc["compile"] = {"enable": True, "components": ["model", "loss"]}
        mapped.add("compile")
        if s.fp8 != "none":
            doc["quantize"] = {"linear": {"float8": {"recipe_name": s.fp8}}}
            if model is None or llama3_flavor(model) is None:
                notes.append('fp8: add "quantize.linear.float8" to [model] converters')
        mapped.add("fp8")
        notes.append(
            f"micro-batches per step = {s.grad_accum_steps} "
            + ("(gradient accumulation)" if s.pp == 1 else "(pipeline micro-batches)")
        )
        command = ""
        if cluster is not None:
            command = shell_words(
                ["torchrun", "--nnodes", cluster.n_nodes, "--nproc-per-node"]
                + [cluster.gpus_per_node, "-m", "torchtitan.train"]
                + ["--job.config_file", "torchtitan.toml"]
            )
        keys, declared, cannot = declared_mappings(self.name, s)
        for dotted, value in keys.items():
            section, key = dotted.split(".", 1)
            doc.setdefault(section, {})[key] = value
        mapped |= declared
        unsupported += cannot
        if s.etp not in (1, s.tp):  # job_config.py Parallelism.expert_tensor_parallel_degree
            mapped.discard("etp")
            unsupported.append(
                ("etp", f"torchtitan runs etp = 1 or etp = tp ({s.tp}) only, not {s.etp}")
            )
        if model is not None and model.moe is not None:
            notes.append(
                "torchtitan's MoE models (deepseek_v3, qwen3, llama4) take their experts from "
                "their own flavors: pick the one with this model's shape in [model]"
            )
        if model is not None and model.mtp_layers:
            notes.append(
                f"{model.name}'s {model.mtp_layers} multi-token prediction module(s) are not "
                "trained (the cost model prices torchtitan without them; its deepseek_v3 "
                "num_mtp_layers, pytorch/torchtitan#3392, is 0 by default)"
            )
        return Exported(
            self.name,
            tomli_w.dumps(doc).rstrip(),
            frozenset(mapped),
            tuple(unsupported),
            tuple(notes),
            command=command,
            filename="torchtitan.toml",
        )


def module_fqns(chunks) -> list[list[str]]:
    """torchtitan's `module_fqns_per_model_part` for layer counts per pipeline chunk: the
    embedding goes with the first chunk, the final norm and the output with the last."""
    parts, start = [], 0
    for i, n in enumerate(chunks):
        names = [f"layers.{j}" for j in range(start, start + n)]
        if i == 0:
            names.insert(0, "tok_embeddings")
        if i == len(chunks) - 1:
            names += ["norm", "output"]
        parts.append(names)
        start += n
    return parts


def llama3_flavor(model) -> str | None:
    """The torchtitan Llama 3 flavor with the shape of `model`, or None."""
    if model.is_gpt_style:
        return None
    shape = (
        model.hidden_size,
        model.n_layers,
        model.n_heads,
        model.n_kv_heads,
        model.ffn_hidden_size,
    )
    for flavor, dims in LLAMA3_FLAVORS.items():
        if dims == shape:
            return flavor
    return None
