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
from autosearch.export._torchtitan_models import ARGS_DICT, model_section

_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}

# section -> keys this exporter may write, all fields of torchtitan 0.2.2 job_config.py.
KEYS: dict[str, tuple[str, ...]] = {
    "model": ("name", "flavor", "converters"),
    "experimental": ("custom_import",),  # Experimental.custom_import: imported by train.py
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
    "training": (
        "local_batch_size",
        "global_batch_size",
        "seq_len",
        "mixed_precision_param",
        "enable_cpu_offload",  # FSDP2 CPUOffloadPolicy: parameters, gradients, optimizer
    ),
    "activation_checkpoint": ("mode", "selective_ac_option"),
    "compile": ("enable", "components"),
    "quantize.linear.float8": ("recipe_name",),
}
# The class of each section in job_config.py (for the check against the installed package).
SECTION_CLASSES = {
    "model": "Model",
    "experimental": "Experimental",
    "parallelism": "Parallelism",
    "training": "Training",
    "activation_checkpoint": "ActivationCheckpoint",
    "compile": "Compile",
    "quantize.linear.float8": "Float8Linear",
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
        fields, module = FieldMap(), ""
        if model is not None:
            arch = architecture_of(model)
            doc["model"], module, fields, model_notes = model_section(model, arch)
            notes += model_notes
            if s.fp8 != "none":
                doc["model"]["converters"] = ["quantize.linear.float8"]
            if module:
                doc["experimental"] = {"custom_import": "torchtitan_flavor"}
                notes.append(
                    f"torchtitan ships no flavor of {model.name}'s shape: torchtitan_flavor.py "
                    f"registers one in {ARGS_DICT[doc['model']['name']]}, imported through "
                    "[experimental] custom_import (torchtitan.sh puts its folder on PYTHONPATH)"
                )
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
            if model is None:
                notes.append('fp8: add "quantize.linear.float8" to [model] converters')
        mapped.add("fp8")
        # torchtitan's one offload switch puts FSDP2's sharded parameters, their gradients and
        # the optimizer step on the CPU together (CPUOffloadPolicy, parallelize.py apply_fsdp)
        if s.offload_params and s.offload_optimizer:
            training["enable_cpu_offload"] = True
            mapped |= {"offload_params", "offload_optimizer"}
        elif s.offload_optimizer:
            unsupported.append(
                (
                    "offload_optimizer",
                    "torchtitan offloads the optimizer only with the parameters "
                    "(training.enable_cpu_offload: FSDP2's CPUOffloadPolicy); set "
                    "offload_params too, with zero_stage 3",
                )
            )
            mapped.add("offload_params")
        else:
            mapped |= {"offload_params", "offload_optimizer"}
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
        return Exported(
            self.name,
            tomli_w.dumps(doc).rstrip(),
            frozenset(mapped),
            tuple(unsupported),
            tuple(notes),
            command=command,
            filename="torchtitan.toml",
            model_fields=tuple(fields.exported.items()),
            refused=tuple(fields.refused.items()),
            script=launch_script(s, model=model, cluster=cluster, refused=fields.refused),
            files=(("torchtitan_flavor.py", module),) if module else (),
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


def launch_script(strategy, *, model=None, cluster=None, refused=None) -> str:
    """torchtitan.sh: `torchtitan.train` under torchrun's c10d rendezvous with torchtitan.toml
    beside it; the data, tokenizer, steps, learning rate and checkpoint folder are placeholders
    given as command-line overrides (torchtitan's ConfigManager: ``--section.key value`` after
    the file). MOCK_DATA=1 runs torchtitan's own smoke set-up from its checkout: the c4_test
    dataset and the test tokenizer in tests/assets (what its run_train.sh uses)."""
    nodes = 1 if cluster is None else cluster.n_nodes
    per_node = strategy.world_size if cluster is None else cluster.gpus_per_node
    setup = [
        require("TRAIN_ITERS", PLACEHOLDERS["TRAIN_ITERS"]),
        require("LR", PLACEHOLDERS["LR"]),
        require("CHECKPOINT_DIR", PLACEHOLDERS["CHECKPOINT_DIR"]),
        'export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"  # torchtitan_flavor.py, if any',
        'if [ "${MOCK_DATA:-0}" = 1 ]; then  # smoke run: torchtitan\'s test data and tokenizer',
        "    "
        + require(
            "TORCHTITAN",
            "set TORCHTITAN to a torchtitan checkout for MOCK_DATA=1: its tests/assets hold "
            "the c4_test data and the test tokenizer",
        ),
        '    cd "$TORCHTITAN"',
        "    DATA=(--training.dataset c4_test --model.hf_assets_path ./tests/assets/tokenizer)",
        "else",
        "    "
        + require(
            "DATA_PATH",
            PLACEHOLDERS["DATA_PATH"].format(data="a Hugging Face dataset folder of c4 form"),
        ),
        "    "
        + require(
            "TOKENIZER",
            PLACEHOLDERS["TOKENIZER"].format(tokenizer="a folder with tokenizer.json"),
        ),
        '    DATA=(--training.dataset c4 --training.dataset_path "$DATA_PATH"'
        ' --model.hf_assets_path "$TOKENIZER")',
        "fi",
    ]
    guard = ""
    if refused:
        guard = refusal("torchtitan", model.name if model else "the model", refused.items())
        guard += "; run with ALLOW_UNSUPPORTED=1 to train it anyway"
    what = f"{model.name} " if model is not None else ""
    return script(
        title=f"torchtitan for {what}with {strategy.short()}, by autosearch",
        comments=[
            "Smoke run: MOCK_DATA=1 TORCHTITAN=/path/to/torchtitan TRAIN_ITERS=10 LR=3e-4 "
            "CHECKPOINT_DIR=/tmp/ckpt bash torchtitan.sh",
            "Several nodes: run it on each (srun --ntasks-per-node 1 bash torchtitan.sh), or "
            "set MASTER_ADDR to the first node on each.",
        ],
        nnodes=nodes,
        gpus_per_node=per_node,
        setup=setup,
        program=["-m torchtitan.train", '--job.config_file "$HERE/torchtitan.toml"'],
        args=[],
        tail=[
            '"${DATA[@]}"',
            '--training.steps "$TRAIN_ITERS" --optimizer.lr "$LR"',
            '--checkpoint.enable --checkpoint.folder "$CHECKPOINT_DIR"',
        ],
        guard=guard,
    )
