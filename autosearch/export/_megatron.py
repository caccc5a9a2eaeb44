"""Megatron-LM (`pretrain_gpt.py` arguments, Megatron-Core era)."""

from __future__ import annotations

from autosearch.export._base import Exported, Exporter


class MegatronExporter(Exporter):
    """Command-line flags of Megatron-LM's `pretrain_gpt.py`.

    Megatron derives dp = WORLD_SIZE / (tp * pp) and the gradient accumulation from the global and
    micro-batch sizes; it runs 1F1B, interleaved when virtual stages are given (Narayanan et al. 2021).
    """

    name = "megatron"

    def export(self, strategy, *, model=None) -> Exported:
        s = strategy
        flags = [
            f"--tensor-model-parallel-size {s.tp}",
            f"--pipeline-model-parallel-size {s.pp}",
            f"--micro-batch-size {s.micro_batch_size}",
            f"--global-batch-size {s.global_batch_size}",
        ]
        unsupported, notes = (
            [],
            [
                f"dp = WORLD_SIZE / (tp*pp) = {s.dp}: launch {s.world_size} processes "
                "(torchrun --nnodes N --nproc-per-node GPUS_PER_NODE)"
            ],
        )
        mapped = {"dp", "tp", "pp", "micro_batch_size", "global_batch_size"}
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
        if s.virtual_stages > 1:
            if model is not None:
                flags.append(
                    f"--num-layers-per-virtual-pipeline-stage {model.n_layers // (s.pp * s.virtual_stages)}"
                )
            else:
                flags.append(f"--num-virtual-stages-per-pipeline-rank {s.virtual_stages}")
                notes.append(
                    "older Megatron-LM releases take --num-layers-per-virtual-pipeline-stage "
                    "n_layers/(pp*virtual_stages) instead (pass --model to get it)"
                )
        mapped.add("virtual_stages")
        if s.sequence_parallel:
            flags.append("--sequence-parallel")
        mapped.add("sequence_parallel")
        if s.recompute == "selective":
            flags.append("--recompute-granularity selective")
        elif s.recompute == "full":
            flags += [
                "--recompute-granularity full",
                "--recompute-method uniform",
                "--recompute-num-layers 1",
            ]
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
        text = " \\\n  ".join(["pretrain_gpt.py"] + flags)
        return Exported(self.name, text, frozenset(mapped), tuple(unsupported), tuple(notes))
