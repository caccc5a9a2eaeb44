"""A model is a sequence of layers: each a mixer (how tokens see each other) and an MLP.

`ModelSpec.layers` gives one `Layer` per block. A catalog or Hugging Face model derives them from
its fields (`ModelSpec.moe` says which MLPs are mixtures of experts, `sliding_window` which
attention layers slide); a model file may also write them in Megatron-Core's hybrid layer
pattern (``megatron/core/ssm/mamba_hybrid_layer_allocation.py``, ``Symbols``; the
``--hybrid-override-pattern`` flag), one symbol per Megatron layer:

=======  ============================================  =====================
symbol   Megatron layer                                 here
=======  ============================================  =====================
``*``    self-attention (MHA / GQA / MLA)               mixer ``attention``
``M``    Mamba-2 (state-space)                          mixer ``mamba``
``G``    Gated DeltaNet (linear attention; autosearch's mixer ``gdn``
         symbol: megatron-core 0.16's Symbols are M * - E,
         and its GPTModel places Gated DeltaNet layers
         by ``linear_attention_freq``)
``P``    attention and Mamba-2 in parallel in one      mixer ``attention+mamba``
         layer, their outputs summed (Falcon-H1;
         autosearch's symbol: Megatron's pattern has
         none, one mixer per Megatron layer)
``S``    Mamba-1 (selective scan; autosearch's symbol:  mixer ``mamba1``
         Megatron-Core has no Mamba-1 layer)
``-``    dense MLP                                      mlp ``dense``
``E``    mixture-of-experts MLP                         mlp ``moe``
=======  ============================================  =====================

A block is a mixer symbol with the MLP symbol after it (``*-``, ``*E``, ``M-``), or either alone
(``M``: a Mamba layer without MLP, as Nemotron-H's; ``-``: an MLP without mixer). Each Megatron
layer has its own pre-norm and residual, so a block of two symbols is two of them: a Llama is
``*-`` repeated, DeepSeek-V3 ``*-*-*-`` then ``*E`` 58 times.

The analytic cost model prices every kind of block: the attention + dense-MLP block, and each
part in which another block differs from it (`cost_models.terms.layers`: MoE MLPs, Mamba-2 and
Gated DeltaNet mixers, attention and Mamba-2 in parallel, a mixer or an MLP alone);
`autosearch.core.model_spec.unpriced` names what a new kind would leave unpriced until its term
exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from autosearch.core.errors import SpecError

MIXERS = {"*": "attention", "M": "mamba", "G": "gdn", "P": "attention+mamba", "S": "mamba1"}
MLPS = {"-": "dense", "E": "moe"}
_SYMBOL = {v: k for k, v in {**MIXERS, **MLPS}.items()}
SYMBOLS = (
    "* attention, M Mamba-2, G Gated DeltaNet, P attention and Mamba-2 in parallel, S Mamba-1, "
    "- dense MLP, E mixture of experts"
)
# mixers that attend (their keys are the sequence or its window) and those with a Mamba-2 part
ATTENDING = ("attention", "attention+mamba")
PATTERN_LIMIT = 1 << 17  # symbols: two per layer of the largest model the limits allow


@dataclass(frozen=True)
class Layer:
    """One block of a model.

    Args:
        mixer: ``attention`` (multi-head, grouped-query or latent, as the model's attention
            fields say), ``mamba``, ``gdn``, ``mamba1``, ``attention+mamba`` (both on the same
            normed input, outputs summed: Falcon-H1's ``FalconH1DecoderLayer``) or ``none``.
        mlp: ``dense``, ``moe`` or ``none``.
        keys: keys a query of an attending mixer (`ATTENDING`) attends to at most (the
            sequence length, or its sliding window); None for other mixers.
    """

    mixer: str
    mlp: str
    keys: int | None = None

    @property
    def symbols(self) -> str:
        """The block in Megatron's hybrid pattern: ``*-``, ``*E``, ``M`` ..."""
        return _SYMBOL.get(self.mixer, "") + _SYMBOL.get(self.mlp, "")

    @property
    def kind(self) -> tuple[str, str]:
        """What prices it: (mixer, mlp)."""
        return self.mixer, self.mlp


def parse_pattern(pattern: str) -> tuple[tuple[str, str], ...]:
    """(mixer, mlp) of each block of a Megatron hybrid pattern, or a SpecError naming the
    first symbol it does not know.

    Example:
        >>> parse_pattern("M-*E-")
        (('mamba', 'dense'), ('attention', 'moe'), ('none', 'dense'))
    """
    if not isinstance(pattern, str) or not pattern:
        raise SpecError(
            f"layer_pattern must be a string of Megatron's hybrid symbols ({SYMBOLS}), got "
            f"{pattern!r}"
        )
    if len(pattern) > PATTERN_LIMIT:
        raise SpecError(f"layer_pattern has {len(pattern):,} symbols, above {PATTERN_LIMIT:,}")
    blocks: list[tuple[str, str]] = []
    open_mixer: str | None = None
    for i, symbol in enumerate(pattern):
        if symbol in MIXERS:
            if open_mixer is not None:
                blocks.append((open_mixer, "none"))
            open_mixer = MIXERS[symbol]
        elif symbol in MLPS:
            blocks.append((open_mixer or "none", MLPS[symbol]))
            open_mixer = None
        else:
            raise SpecError(
                f"layer_pattern {_clip(pattern)!r}: symbol {symbol!r} at position {i} is not one "
                f"of Megatron's hybrid symbols: {SYMBOLS}"
            )
    if open_mixer is not None:
        blocks.append((open_mixer, "none"))
    return tuple(blocks)


def pattern_of(layers: "tuple[Layer, ...]") -> str:
    """The compact form of `layers` (Megatron's hybrid pattern)."""
    return "".join(layer.symbols for layer in layers)


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
