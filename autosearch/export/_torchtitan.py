"""torchtitan (the job-config TOML of `torchtitan/train.py`)."""

from __future__ import annotations

from autosearch.export._base import Exported, Exporter

_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


class TorchTitanExporter(Exporter):
    """The `[parallelism]`, `[training]` and `[activation_checkpoint]` sections of a torchtitan job
    config. torchtitan composes FSDP2 (ZeRO-3 over `data_parallel_shard_degree`), DTensor tensor
    parallel (with sequence parallel on the norms always on) and torch.distributed.pipelining."""

    name = "torchtitan"

    def export(self, strategy, *, model=None) -> Exported:
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
            "recompute",
        }
        shard, replicate = (s.dp, 1) if s.zero_stage >= 2 else (1, s.dp)
        lines = [
            "[parallelism]",
            f"data_parallel_replicate_degree = {replicate}",
            f"data_parallel_shard_degree = {shard}",
            f"tensor_parallel_degree = {s.tp}",
            f"pipeline_parallel_degree = {s.pp}",
        ]
        if s.pp > 1:
            lines.append(f'pipeline_parallel_schedule = "{_SCHEDULES[s.pipeline_schedule]}"')
            lines.append(f"pipeline_parallel_microbatch_size = {s.micro_batch_size}")
            if s.virtual_stages > 1 and model is not None:
                lines.append(
                    f"pipeline_parallel_layers_per_stage = {model.n_layers // (s.pp * s.virtual_stages)}"
                )
            elif s.virtual_stages > 1:
                notes.append(
                    f"set pipeline_parallel_layers_per_stage = n_layers / {s.pp * s.virtual_stages} "
                    "(pass --model to compute it)"
                )
        if s.zero_stage == 2:
            lines.append('fsdp_reshard_after_forward = "never"')
        elif s.zero_stage == 3:
            lines.append('fsdp_reshard_after_forward = "always"')
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
                    "torchtitan's tensor parallel always shards the norms over the tp "
                    "group (sequence parallel); it cannot be turned off",
                )
            )
        else:
            mapped.add("sequence_parallel")
        lines += [
            "",
            "[training]",
            f"global_batch_size = {s.global_batch_size}",
            f"local_batch_size = {s.global_batch_size // s.dp}",
        ]
        if s.amp in _DTYPES:
            lines.append(f'mixed_precision_param = "{_DTYPES[s.amp]}"')
            mapped.add("amp")
        else:
            lines.append('mixed_precision_param = "bfloat16"')
            unsupported.append(
                (
                    "amp",
                    "fp16 needs a gradient scaler, which torchtitan's FSDP2 mixed precision does not "
                    "set up; bfloat16 is exported instead",
                )
            )
        mode = {"none": "none", "selective": "selective", "full": "full"}[s.recompute]
        lines += ["", "[activation_checkpoint]", f'mode = "{mode}"']
        if s.recompute == "selective":
            lines.append('selective_ac_option = "op"')
            notes.append(
                "torchtitan's selective AC saves matmul outputs per op policy; close to, not the same as, "
                "recomputing the attention core only (Korthikanti et al. 2022)"
            )
        notes.append(
            f"local_batch_size is per data-parallel rank; micro-batches per step = {s.grad_accum_steps}"
        )
        return Exported(
            self.name, "\n".join(lines), frozenset(mapped), tuple(unsupported), tuple(notes)
        )
