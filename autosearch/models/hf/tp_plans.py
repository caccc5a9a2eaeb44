"""The pieces the Hugging Face wrappers' tensor-parallel plans are made of, on transformers'
module names: Megatron's column/row split of a sub-layer (Shoeybi et al. 2019, sec. 3) with
sequence parallel between sub-layers (Korthikanti et al. 2022), as torchtitan writes it for
Llama. Each wrapper's plan (`HFCausalLM.tp_plan`, gpt.py's, the hybrids' in hybrid.py) is these
entries on its own names plus what only it has.
"""

from __future__ import annotations

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

LAYER = "model.layers.*."  # every decoder layer of transformers' Llama-layout base model


def activations(sequence_parallel: bool) -> Placement:
    """The layout of the residual stream between sub-layers: this rank's shard of the sequence
    under sequence parallel, else replicated."""
    return Shard(1) if sequence_parallel else Replicate()


def vocab_entries(*embeddings: str, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """The embedding tables split by rows (vocabulary, or GPT-2's positions) and ``lm_head`` by
    vocabulary columns, its logits left sharded for a vocabulary-parallel loss."""
    act = activations(sequence_parallel)
    plan: dict = {
        name: RowwiseParallel(input_layouts=Replicate(), output_layouts=act) for name in embeddings
    }
    plan["lm_head"] = ColwiseParallel(
        input_layouts=act,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    return plan


def column_row_entries(
    prefix: str, columns: tuple[str, ...], row: str, *, sequence_parallel: bool
) -> dict:
    """Megatron's split of one sub-layer under `prefix`: the `columns` projections column-wise
    (each rank its heads or hidden units), `row` row-wise (its partial sums all-reduced, or
    reduce-scattered onto the sequence shards under sequence parallel)."""
    return {
        **{prefix + name: ColwiseParallel() for name in columns},
        prefix + row: RowwiseParallel(output_layouts=activations(sequence_parallel)),
    }


def attention_entries(attention: str, *, sequence_parallel: bool) -> dict:
    """`column_row_entries` of transformers' attention modules `attention` (a pattern such as
    ``model.layers.*.self_attn``): q/k/v_proj column-wise (each rank its heads), o_proj
    row-wise."""
    qkv = ("q_proj", "k_proj", "v_proj")
    return column_row_entries(attention + ".", qkv, "o_proj", sequence_parallel=sequence_parallel)


def gather_input(
    *, by_keyword: bool = False, use_local_output: bool = False
) -> PrepareModuleInput:
    """A sub-layer's input gathered from the ranks' shards of the sequence (sequence parallel):
    ``hidden_states`` by keyword (as transformers passes an attention module its input), else
    the first positional argument (an MLP's, a mixer's)."""
    if by_keyword:
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=use_local_output,
        )
    return PrepareModuleInput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_output=use_local_output,
    )


def llama_layout_entries(*, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """What every model of transformers' Llama layout splits alike: ``model.embed_tokens`` and
    ``lm_head`` (`vocab_entries`) and each layer's ``self_attn`` (`attention_entries`)."""
    return {
        **vocab_entries(
            "model.embed_tokens", sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
        ),
        **attention_entries(LAYER + "self_attn", sequence_parallel=sequence_parallel),
    }


def llama_sequence_parallel_entries(*, mlp: str = "mlp") -> dict:
    """Sequence parallel in transformers' pre-norm layers of the Llama layout: the final norm and
    each layer's input and post-attention norms on the ranks' shards of the sequence, the inputs
    of ``self_attn`` and of the layer's `mlp` gathered."""
    return {
        "model.norm": SequenceParallel(),
        LAYER + "input_layernorm": SequenceParallel(),
        LAYER + "post_attention_layernorm": SequenceParallel(),
        LAYER + "self_attn": gather_input(by_keyword=True),
        LAYER + mlp: gather_input(),
    }
