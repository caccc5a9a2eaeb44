"""ModelSpec: the shape of a decoder-only transformer, and the catalog of real models.

Two styles, chosen by `ffn_activation`, matching the reference transformer in
`autosearch.transformer` and the published architectures:

* ``gelu``  -> GPT style (Radford et al. 2019; Brown et al. 2020): LayerNorm with bias, biases in
  every linear layer, learned position embeddings, dropout.
* ``swiglu`` -> Llama style (Touvron et al. 2023): RMSNorm, no biases, rotary positions, no
dropout,
  gated MLP with three matrices.

Example:
    >>> from autosearch import ModelSpec
    >>> m = ModelSpec.load("gpt3-175b")
    >>> round(m.n_params / 1e9, 1)
    174.6
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from autosearch.core._io import check_keys, check_name, name_from, positive_int, read_yaml_mapping
from autosearch.core.errors import SpecError

FFN_ACTIVATIONS = ("gelu", "swiglu")
POSITION_EMBEDDINGS = ("learned", "rotary", "alibi")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, by the numbers that decide its cost.

    Args:
        name: a label (catalog names are lowercase with hyphens: ``llama3-8b``): letters, digits
            and ``._+=-/``, as it is written into scripts and configs (`_io.check_name`).
        n_layers: transformer blocks.
        hidden_size: model width h.
        n_heads: attention heads a.
        n_kv_heads: key/value heads (grouped-query attention); defaults to ``n_heads``.
        ffn_hidden_size: MLP width; defaults to ``4 * hidden_size``.
        ffn_activation: ``gelu`` (GPT style) or ``swiglu`` (Llama style).
        vocab_size: vocabulary V.
        seq_len: training sequence length s.
        tied_embeddings: the output projection shares the input embedding matrix.
        position_embedding: ``learned`` (GPT), ``rotary`` (Llama) or ``alibi`` (MPT: no
            parameters, a bias on the attention scores); defaults by `ffn_activation`.
        linear_bias: biases in the linear layers and norms; defaults to GPT style.
        dropout: dropout after attention and MLP (it stores masks); defaults to GPT style.
    """

    name: str = "custom"
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int = None  # type: ignore[assignment]  # None: n_heads, set in __post_init__
    ffn_hidden_size: int = None  # type: ignore[assignment]  # None: 4 * hidden_size
    ffn_activation: str = "gelu"
    vocab_size: int
    seq_len: int
    tied_embeddings: bool = False
    position_embedding: str = None  # type: ignore[assignment]  # None: by ffn_activation
    linear_bias: bool = None  # type: ignore[assignment]  # None: GPT style (gelu)
    dropout: bool = None  # type: ignore[assignment]  # None: GPT style (gelu)

    def __post_init__(self) -> None:
        check_name(self.name, "model name")
        problems = []
        gpt = self.ffn_activation == "gelu"
        for name, fallback in (
            ("position_embedding", "learned" if gpt else "rotary"),
            ("linear_bias", gpt),
            ("dropout", gpt),
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, fallback)
        if self.position_embedding not in POSITION_EMBEDDINGS:
            problems.append(
                f"position_embedding must be one of {POSITION_EMBEDDINGS}, "
                f"got {self.position_embedding!r}"
            )
        for name in ("linear_bias", "dropout"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("n_layers", "hidden_size", "n_heads", "vocab_size", "seq_len"):
            try:
                object.__setattr__(self, name, positive_int(getattr(self, name), name))
            except SpecError as exc:
                problems.append(str(exc))
        defaults: tuple[tuple[str, int | None], ...] = (
            ("n_kv_heads", self.n_heads),
            (
                "ffn_hidden_size",
                4 * self.hidden_size if isinstance(self.hidden_size, int) else None,
            ),
        )
        for name, default in defaults:
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, default)
            else:
                try:
                    object.__setattr__(self, name, positive_int(value, name))
                except SpecError as exc:
                    problems.append(str(exc))
        if self.ffn_activation not in FFN_ACTIVATIONS:
            problems.append(
                f"ffn_activation must be one of {FFN_ACTIVATIONS}, got {self.ffn_activation!r}"
            )
        if not isinstance(self.tied_embeddings, bool):
            problems.append(f"tied_embeddings must be true or false, got {self.tied_embeddings!r}")
        if not problems:
            if self.hidden_size % self.n_heads:
                problems.append(
                    f"hidden_size {self.hidden_size} must be a multiple of n_heads {self.n_heads} "
                    "(head size = hidden_size / n_heads)"
                )
            if self.n_heads % self.n_kv_heads:
                problems.append(
                    f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads} "
                    "(each key/value head serves a whole group of query heads)"
                )
        if problems:
            raise SpecError(problems, context=f"model {self.name!r}")

    # ---- derived shape -------------------------------------------------------------------------
    @property
    def is_gpt_style(self) -> bool:
        """GPT style (gelu, biases, LayerNorm, learned positions, dropout) vs Llama style."""
        return self.ffn_activation == "gelu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def kv_hidden_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_ffn_matrices(self) -> int:
        return 2 if self.ffn_activation == "gelu" else 3

    @property
    def layer_matmul_params(self) -> int:
        """Weights of the matrix multiplies of one block (QKV, output projection, MLP)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return h * (h + 2 * self.kv_hidden_size) + h * h + self.n_ffn_matrices * h * f

    @property
    def layer_params(self) -> int:
        """All parameters of one block, biases and norms included.

        GPT style: 12h^2 + 13h for ffn = 4h (Narayanan et al. 2021, sec. 3: P = 12lh^2(1 + 13/(12h)
        + ...)).
        """
        h, f = self.hidden_size, self.ffn_hidden_size
        n = self.layer_matmul_params
        if self.linear_bias:
            biases = (h + 2 * self.kv_hidden_size) + h + (self.n_ffn_matrices - 1) * f + h
            norms = 2 * 2 * h  # two LayerNorms, weight and bias
            return n + biases + norms
        return n + 2 * h  # two norm weights (RMSNorm, or LayerNorm without bias), no biases

    @property
    def embedding_params(self) -> int:
        """Token embedding (+ learned positions)."""
        learned = self.position_embedding == "learned"
        positions = self.seq_len * self.hidden_size if learned else 0
        return self.vocab_size * self.hidden_size + positions

    @property
    def head_params(self) -> int:
        """Final norm and, if untied, the output projection."""
        norm = 2 * self.hidden_size if self.linear_bias else self.hidden_size
        return norm + (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)

    @property
    def n_params(self) -> int:
        return self.n_layers * self.layer_params + self.embedding_params + self.head_params

    def flops_per_token(self, *, training: bool = True) -> float:
        """Model FLOPs per token, counting matrix multiplies only (the usual MFU convention).

        Forward: 2 FLOPs per weight of every block matmul and of the logits, plus the attention
        scores and weighted sum, 2 * 2 * s * h per layer (full, not causal-halved). Training is
        3x forward. For GPT shapes this is Narayanan et al. 2021 eq. (3) without recompute:
        72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per batch of B sequences; PaLM's 6N + 12 l h s.
        """
        forward = (
            2 * self.n_layers * self.layer_matmul_params
            + 2 * self.vocab_size * self.hidden_size
            + 4 * self.n_layers * self.seq_len * self.hidden_size
        )
        return 3.0 * forward if training else float(forward)

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, what: str = "model") -> "ModelSpec":
        kwargs = check_keys(data, cls, what=what)
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in kwargs
        ]
        if missing:
            raise SpecError(f"{what}: missing required key(s) {', '.join(missing)}")
        return cls(**kwargs)

    @classmethod
    def from_hf_config(
        cls, source, *, name: str | None = None, seq_len: int | None = None
    ) -> "ModelSpec":
        """A ModelSpec from a Hugging Face config.json, dict or PretrainedConfig
        (`autosearch.core.hf_config`)."""
        from autosearch.core.hf_config import spec_fields

        return cls(**spec_fields(source, name=name, seq_len=seq_len))

    @classmethod
    def load(cls, name_or_path: "str | os.PathLike | ModelSpec") -> "ModelSpec":
        """A catalog model by name (``llama3-70b``), a YAML file with the fields above, or a
        Hugging Face ``config.json`` (`from_hf_config`)."""
        if isinstance(name_or_path, ModelSpec):
            return name_or_path
        key = os.fspath(name_or_path)
        catalog = model_catalog()
        if key.lower() in catalog:
            return catalog[key.lower()]
        if key.endswith(".json"):  # a Hugging Face config.json
            return cls.from_hf_config(key)
        if key.endswith((".yaml", ".yml")) or os.path.sep in key or os.path.exists(key):
            data = read_yaml_mapping(key, what="model")
            data.setdefault("name", name_from(os.path.splitext(os.path.basename(key))[0]))
            return cls.from_dict(data, what=f"model file {key!r}")
        family = re.sub(r"[^a-z].*", "", key.lower())  # the leading letters
        close = difflib.get_close_matches(key.lower(), catalog, n=4, cutoff=0.6)
        close += [n for n in catalog if family and n.startswith(family) and n not in close][
            : 8 - len(close)
        ]
        hint = f" Similar names: {', '.join(close)}." if close else ""
        raise SpecError(
            f"unknown model {key!r}: not in the catalog and not a YAML file.{hint} Run `autosearch"
            " models` for the catalog, or pass a YAML file with n_layers, hidden_size, n_heads,"
            " vocab_size and seq_len."
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def scaled(self, **changes: Any) -> "ModelSpec":
        """A copy with some fields changed (e.g. fewer layers to run a catalog model on a CPU).

        Derived defaults follow the change: a model whose kv heads were its heads keeps them equal
        when n_heads changes, and an ffn of 4 * hidden stays 4 * hidden when hidden_size changes.
        """
        if (
            "n_heads" in changes
            and "n_kv_heads" not in changes
            and self.n_kv_heads == self.n_heads
        ):
            changes["n_kv_heads"] = None
        if (
            "hidden_size" in changes
            and "ffn_hidden_size" not in changes
            and self.ffn_hidden_size == 4 * self.hidden_size
        ):
            changes["ffn_hidden_size"] = None
        return dataclasses.replace(self, **changes)


@functools.cache
def model_catalog() -> dict[str, ModelSpec]:
    """Every model of `autosearch/core/models.yaml`, by name (sources are cited in that file)."""
    text = resources.files("autosearch.core").joinpath("models.yaml").read_text(encoding="utf-8")
    entries = yaml.safe_load(text)["models"]
    return {
        name: ModelSpec.from_dict({"name": name, **fields}, what=f"catalog model {name!r}")
        for name, fields in entries.items()
    }
