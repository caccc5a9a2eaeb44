"""DeepSpeed: the `ds_config.json` passed to `deepspeed.initialize`, and the `deepspeed` launch
line.

Every key was checked against DeepSpeed 0.19.8 (installed with DS_BUILD_OPS=0 and
`pip install --no-deps`, read, not imported); `KEYS` cites the file of each.
"""

from __future__ import annotations

import json

from autosearch.export._architecture import MODEL_FIELDS, architecture_of, field_values
from autosearch.export._base import Exported, Exporter, declared_mappings, shell_words
from autosearch.export._launch import PLACEHOLDERS, require, script

# Config key path -> where DeepSpeed defines it. tests/test_export.py checks that every key an
# export writes is here.
KEYS: dict[str, str] = {
    "train_batch_size": "deepspeed/runtime/constants.py TRAIN_BATCH_SIZE",
    "train_micro_batch_size_per_gpu": "deepspeed/runtime/constants.py "
    "TRAIN_MICRO_BATCH_SIZE_PER_GPU",
    "gradient_accumulation_steps": "deepspeed/runtime/constants.py GRADIENT_ACCUMULATION_STEPS",
    "zero_optimization": "deepspeed/runtime/zero/config.py ZERO_OPTIMIZATION",
    "zero_optimization.stage": "deepspeed/runtime/zero/config.py DeepSpeedZeroConfig.stage",
    "bf16": "deepspeed/runtime/precision_config.py BFLOAT16",
    "bf16.enabled": "deepspeed/runtime/constants.py BFLOAT16_ENABLED",
    "fp16": "deepspeed/runtime/precision_config.py FP16",
    "fp16.enabled": "deepspeed/runtime/constants.py FP16_ENABLED",
    "fp16.loss_scale": "deepspeed/runtime/constants.py FP16_LOSS_SCALE",
    "fp16.initial_scale_power": "deepspeed/runtime/constants.py FP16_INITIAL_SCALE_POWER",
    "tensor_parallel": "deepspeed/runtime/tensor_parallel/config.py get_tensor_parallel_config",
    "tensor_parallel.autotp_size": "deepspeed/runtime/tensor_parallel/config.py "
    "TPTrainingConfig.autotp_size",
    "pipeline": "deepspeed/runtime/config.py get_pipeline_config",
    "pipeline.stages": "deepspeed/runtime/config.py get_pipeline_config default_pipeline",
    "activation_checkpointing": "deepspeed/runtime/activation_checkpointing/config.py",
    "activation_checkpointing.partition_activations": "activation_checkpointing/config.py "
    "ACT_CHKPT_PARTITION_ACTIVATIONS",
    "activation_checkpointing.contiguous_memory_optimization": "activation_checkpointing/"
    "config.py ACT_CHKPT_CONTIGUOUS_MEMORY_OPTIMIZATION",
    "activation_checkpointing.cpu_checkpointing": "activation_checkpointing/config.py "
    "ACT_CHKPT_CPU_CHECKPOINTING",
    "zero_optimization.offload_optimizer": "deepspeed/runtime/zero/config.py "
    "DeepSpeedZeroConfig.offload_optimizer (ZeRO-Offload, stages 1-3)",
    "zero_optimization.offload_optimizer.device": "deepspeed/runtime/zero/offload_config.py "
    "DeepSpeedZeroOffloadOptimizerConfig.device",
    "zero_optimization.offload_optimizer.pin_memory": "deepspeed/runtime/zero/offload_config.py "
    "DeepSpeedZeroOffloadOptimizerConfig.pin_memory",
    "zero_optimization.offload_param": "deepspeed/runtime/zero/config.py "
    "DeepSpeedZeroConfig.offload_param (ZeRO-Infinity, stage 3)",
    "zero_optimization.offload_param.device": "deepspeed/runtime/zero/offload_config.py "
    "DeepSpeedZeroOffloadParamConfig.device",
    "zero_optimization.offload_param.pin_memory": "deepspeed/runtime/zero/offload_config.py "
    "DeepSpeedZeroOffloadParamConfig.pin_memory",
}
# Launcher flags: deepspeed/launcher/runner.py (--num_nodes, --num_gpus, --hostfile) and
# deepspeed/__init__.py _add_core_arguments (--deepspeed, --deepspeed_config).
LAUNCH_FLAGS = ("--num_nodes", "--num_gpus", "--hostfile", "--deepspeed", "--deepspeed_config")


class DeepSpeedExporter(Exporter):
    """A DeepSpeed JSON config. Batch sizes, ZeRO stage and precision live in the config; tensor
    parallel through AutoTP (`tensor_parallel.autotp_size`, DeepSpeed >= 0.16.4); pipeline stages
    through `deepspeed.pipe.PipelineModule(num_stages=pp)` in the model code (`pipeline.stages` in
    the config records it). The model's shape is the user's code: DeepSpeed has no model keys."""

    name = "deepspeed"

    def export(self, strategy, *, model=None, cluster=None) -> Exported:
        s = strategy
        cfg: dict = {
            "train_batch_size": s.global_batch_size,
            "train_micro_batch_size_per_gpu": s.micro_batch_size,
            "gradient_accumulation_steps": s.grad_accum_steps,
            "zero_optimization": {"stage": s.zero_stage},
        }
        mapped = {"dp", "micro_batch_size", "global_batch_size", "amp"}
        unsupported, notes = [], [f"data parallel = WORLD_SIZE / (tp*pp*cp) = {s.dp}"]
        if s.amp == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif s.amp == "fp16":
            cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
        if s.tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": s.tp}
        mapped.add("tp")
        if s.pp > 1:
            cfg["pipeline"] = {"stages": s.pp}
            notes.append(
                f"pipeline: build the model as deepspeed.pipe.PipelineModule(layers, "
                f"num_stages={s.pp}); the engine reads the degree from the module"
            )
        mapped.add("pp")
        if s.pp > 1 and s.zero_stage >= 2:
            unsupported.append(
                (
                    "zero_stage",
                    f"DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only, "
                    f"not {s.zero_stage}",
                )
            )
        else:
            mapped.add("zero_stage")
        if s.pp > 1 and s.pipeline_schedule != "1f1b":
            unsupported.append(
                (
                    "pipeline_schedule",
                    f"DeepSpeed pipelines run their own 1F1B-style TrainSchedule; "
                    f"{s.pipeline_schedule} is not available",
                )
            )
        else:
            mapped.add("pipeline_schedule")
        if s.virtual_stages > 1:
            unsupported.append(
                ("virtual_stages", "DeepSpeed pipelines have no interleaving (virtual stages)")
            )
        else:
            mapped.add("virtual_stages")
        if s.recompute == "full":
            cfg["activation_checkpointing"] = {
                "partition_activations": s.tp > 1,
                "contiguous_memory_optimization": False,
                "cpu_checkpointing": False,
            }
            notes.append(
                "full recompute: wrap each block in deepspeed.checkpointing.checkpoint in the "
                "model code"
            )
            mapped.add("recompute")
        elif s.recompute in ("selective", "selective_op"):
            unsupported.append(
                (
                    "recompute",
                    "selective (attention-only) recompute is a Megatron-LM feature; "
                    "DeepSpeed checkpoints whole blocks (use full, or none)",
                )
            )
        else:
            mapped.add("recompute")
        if s.sequence_parallel:
            unsupported.append(
                (
                    "sequence_parallel",
                    "Megatron-style sequence parallelism over the tp group has no "
                    "DeepSpeed config key (DeepSpeed-Ulysses is a different scheme)",
                )
            )
        else:
            mapped.add("sequence_parallel")
        # Axes DeepSpeed's config cannot express; each is mapped when it is off.
        for field, on, why in (
            (
                "cp",
                s.cp > 1,
                "no ring context parallel; DeepSpeed-Ulysses splits the sequence another way",
            ),
            (
                "recompute_num_layers",
                s.recompute_num_layers is not None,
                "which blocks are checkpointed is the training script's choice, not a config key",
            ),
            (
                "pipeline_split",
                s.pipeline_split is not None,
                "the layer split is PipelineModule(partition_method=...) in the model code",
            ),
            ("fp8", s.fp8 != "none", "fp8 matmuls come from TransformerEngine in the model code"),
            ("compile", s.compile, "no config key: call engine.compile() after initialize"),
            ("async_tp", s.async_tp, "AutoTP does not overlap its collectives with the matmuls"),
        ):
            if on:
                unsupported.append((field, why))
            else:
                mapped.add(field)
        # ZeRO-Offload / ZeRO-Infinity to pinned host memory (offload_config.py)
        zero = cfg["zero_optimization"]
        if s.offload_optimizer and s.zero_stage == 0:
            unsupported.append(
                (
                    "offload_optimizer",
                    "DeepSpeed offloads the optimizer under ZeRO stages 1-3 only; "
                    "use zero_stage 1 or more",
                )
            )
        elif s.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            mapped.add("offload_optimizer")
            notes.append("offload_optimizer: DeepSpeed steps DeepSpeedCPUAdam on the host")
        else:
            mapped.add("offload_optimizer")
        if s.offload_params:  # the rules hold it to zero_stage 3
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        mapped.add("offload_params")
        _, declared, cannot = declared_mappings(self.name, s)
        mapped |= declared
        unsupported += cannot
        fields: tuple[tuple[str, str], ...] = ()
        refused: tuple[tuple[str, str], ...] = ()
        if model is not None:
            values = field_values(model, architecture_of(model))
            refused = hybrid_refusals(model)
            fields = tuple(
                (f, f"TRAIN_SCRIPT's model: {values[f]!r} (DeepSpeed has no model keys)")
                for f in MODEL_FIELDS
                if f not in dict(refused)
            )
            notes.append(
                f"the model ({model.name}: {model.n_layers} layers, hidden {model.hidden_size}, "
                f"{model.n_heads} heads, seq {model.seq_len}) is built by your training script; "
                "DeepSpeed's config has no model keys"
            )
        return Exported(
            self.name,
            json.dumps(cfg, indent=2),
            frozenset(mapped),
            tuple(unsupported),
            tuple(notes),
            command=launch_command(s, cluster),
            filename="ds_config.json",
            model_fields=fields,
            refused=refused,
            script=launch_script(s, model=model, cluster=cluster),
        )


def hybrid_refusals(model) -> tuple[tuple[str, str], ...]:
    """The hybrid parts of `model` DeepSpeed does not train: it runs the training script's own
    modules with no Mamba-2 or Gated DeltaNet kernels of its own (AutoTP shards nn.Linear
    layers by name, and ZeRO is layer-agnostic), so autosearch prices DeepSpeed for attention +
    MLP blocks only (cost_models/runtimes.yaml ``deepspeed`` supports neither ``mamba`` nor
    ``gdn``); Megatron-Core trains them (``--to megatron``)."""
    lacks = (
        "DeepSpeed has no {what} (its preset prices attention + MLP blocks); export --to megatron"
    )
    out = []
    if any(layer.mixer != "attention" or layer.mlp == "none" for layer in model.layers):
        out.append(("layer_pattern", lacks.format(what=f"hybrid layers ({model.pattern[:40]})")))
    if model.mamba is not None:
        out.append(("mamba", lacks.format(what="Mamba-2 mixer")))
    if model.gdn is not None:
        out.append(("gdn", lacks.format(what="Gated DeltaNet mixer")))
    if model.mamba1 is not None:
        out.append(("mamba1", lacks.format(what="Mamba-1 mixer")))
    if model.attention_output_gate:
        out.append(("attention_output_gate", lacks.format(what="gated attention")))
    return tuple(out)


def launch_command(strategy, cluster=None) -> str:
    """The `deepspeed` launcher line for `ds_config.json` (TRAIN_SCRIPT is the user's)."""
    if cluster is not None:
        nodes, per_node = cluster.n_nodes, cluster.gpus_per_node
    else:
        nodes, per_node = 1, strategy.world_size
    hostfile = ["--hostfile", "hostfile"] if nodes > 1 else []
    return shell_words(
        ["deepspeed", "--num_nodes", nodes, "--num_gpus", per_node, *hostfile, "TRAIN_SCRIPT.py"]
        + ["--deepspeed", "--deepspeed_config", "ds_config.json"]
    )


def launch_script(strategy, *, model=None, cluster=None) -> str:
    """deepspeed_launch.sh: the user's DeepSpeed training script under torchrun's c10d
    rendezvous (deepspeed.init_distributed reads torchrun's environment), with ds_config.json.
    The data, tokenizer, steps, learning rate and checkpoint folder are placeholders passed on
    in the environment, as is MOCK_DATA=1 for a smoke run on the script's own mock data:
    DeepSpeed has no data loader of its own to switch."""
    nodes = 1 if cluster is None else cluster.n_nodes
    per_node = strategy.world_size if cluster is None else cluster.gpus_per_node
    setup = [
        require(
            "TRAIN_SCRIPT",
            "set TRAIN_SCRIPT to your DeepSpeed training script, which builds the model and "
            "calls deepspeed.initialize with the config",
        ),
        require("TRAIN_ITERS", PLACEHOLDERS["TRAIN_ITERS"]),
        require("LR", PLACEHOLDERS["LR"]),
        require("CHECKPOINT_DIR", PLACEHOLDERS["CHECKPOINT_DIR"]),
        'if [ "${MOCK_DATA:-0}" != 1 ]; then',
        "    " + require("DATA_PATH", PLACEHOLDERS["DATA_PATH"].format(data="your script's")),
        "    " + require("TOKENIZER", PLACEHOLDERS["TOKENIZER"].format(tokenizer="your script's")),
        "fi",
        "export MOCK_DATA DATA_PATH TOKENIZER TRAIN_ITERS LR CHECKPOINT_DIR  # for TRAIN_SCRIPT",
    ]
    what = f"{model.name} " if model is not None else ""
    return script(
        title=f"DeepSpeed for {what}with {strategy.short()}, by autosearch",
        comments=[
            "Smoke run: MOCK_DATA=1 TRAIN_SCRIPT=train.py TRAIN_ITERS=10 LR=3e-4 "
            "CHECKPOINT_DIR=/tmp/ckpt bash deepspeed_launch.sh",
            "TRAIN_SCRIPT reads MOCK_DATA, DATA_PATH, TOKENIZER, TRAIN_ITERS, LR and "
            "CHECKPOINT_DIR from the environment.",
        ],
        nnodes=nodes,
        gpus_per_node=per_node,
        setup=setup,
        program=['"$TRAIN_SCRIPT"'],
        args=[],
        tail=['--deepspeed --deepspeed_config "$HERE/ds_config.json"'],
    )
