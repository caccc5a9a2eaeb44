"""DeepSpeed (the `ds_config.json` passed to `deepspeed.initialize`)."""

from __future__ import annotations

import json

from autosearch.export._base import Exported, Exporter


class DeepSpeedExporter(Exporter):
    """A DeepSpeed JSON config. Batch sizes, ZeRO stage and precision live in the config; tensor
    parallel through AutoTP (`tensor_parallel.autotp_size`, DeepSpeed >= 0.16.4); pipeline stages
    through `deepspeed.pipe.PipelineModule(num_stages=pp)` in the model code."""

    name = "deepspeed"

    def export(self, strategy, *, model=None) -> Exported:
        s = strategy
        cfg: dict = {
            "train_batch_size": s.global_batch_size,
            "train_micro_batch_size_per_gpu": s.micro_batch_size,
            "gradient_accumulation_steps": s.grad_accum_steps,
            "zero_optimization": {"stage": s.zero_stage},
        }
        mapped = {"dp", "micro_batch_size", "global_batch_size", "amp"}
        unsupported, notes = [], [f"data parallel = WORLD_SIZE / (tp*pp) = {s.dp}"]
        if s.amp == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif s.amp == "fp16":
            cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
        if s.tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": s.tp}
        mapped.add("tp")
        if s.pp > 1:
            notes.append(
                f"pipeline: build the model as deepspeed.pipe.PipelineModule(layers, num_stages={s.pp}); "
                "the config has no pipeline degree"
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
                "full recompute: wrap each block in deepspeed.checkpointing.checkpoint in the model code"
            )
            mapped.add("recompute")
        elif s.recompute == "selective":
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
        return Exported(
            self.name,
            json.dumps(cfg, indent=2),
            frozenset(mapped),
            tuple(unsupported),
            tuple(notes),
        )
