"""LoRA: low-rank adapters on a frozen model (Hu et al. 2021), the model-side part of a ModelSpec.

A targeted linear layer ``y = x W`` (W: in x out, frozen) gains ``(alpha / rank) x A B`` with A
(in x rank) and B (rank x out) trained; everything else is frozen. Read from YAML as::

    lora: {rank: 16, targets: [q, k, v, o, gate, up, down]}

Targets use Hugging Face's projection names without ``_proj`` (peft's ``target_modules``):
``q k v o`` (attention), ``gate up down`` (MLP; a GPT-style MLP has ``up`` = fc1 and
``down`` = fc2, no gate); ``attention``, ``mlp`` and ``all`` name the groups. Megatron-Core
fuses Q, K and V into one matrix (``linear_qkv``) and a gated MLP's gate and up into one
(``linear_fc1``); Megatron-Bridge puts one adapter on each fused matrix (one A, shared rank):
the targets ``qkv`` and ``gate_up``, which Megatron-Bridge's module names ``linear_qkv /
linear_proj / linear_fc1 / linear_fc2`` resolve to (``qkv / o / gate_up / down``). Dropout is
irrelevant for cost and is not described.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosearch.core._io import check_keys, positive_int
from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.model_spec import ModelSpec

LORA_TARGETS = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")
SEPARATE = ("q", "k", "v", "o", "gate", "up", "down")  # Hugging Face's modules (peft's default)
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}  # Megatron-Core's fused matrices
TARGET_GROUPS = {
    "attention": ("q", "k", "v", "o"),
    "mlp": ("gate", "up", "down"),
    "all": SEPARATE,
    # Megatron-Bridge's module names (megatron/bridge/peft/lora.py)
    "linear_qkv": ("qkv",),
    "linear_proj": ("o",),
    "linear_fc1": ("gate_up",),  # ("up",) in a model without a gate
    "linear_fc2": ("down",),
}
_SHORT = {"qkv": "QKV", "gate_up": "GU"}
_RANK_LIMIT = 1 << 20


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """Low-rank adapters on some of the block's linear layers; the rest of the model is frozen.

    Args:
        rank: r, the adapters' inner width (peft ``r``, Megatron-Bridge ``dim``).
        alpha: the adapters' scale is alpha / rank; default rank (scale 1). No effect on cost.
        targets: which linear layers of every block get an adapter (`LORA_TARGETS`, or a group
            of `TARGET_GROUPS`); None: every linear layer of the block (Megatron-Bridge's
            default, all four of its modules).
    """

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] | None = None

    def check(self, model: "ModelSpec") -> "LoraSpec":
        """This spec with its targets resolved for `model` (a tuple in `LORA_TARGETS` order), or
        a SpecError naming every problem and its fix."""
        p: list[str] = []
        try:
            rank = positive_int(self.rank, "lora.rank", maximum=_RANK_LIMIT)
        except SpecError as exc:
            p.append(f"{exc} (the adapters' inner width, e.g. 16)")
            rank = None
        alpha = self.alpha
        if alpha is not None and (
            isinstance(alpha, bool)
            or not isinstance(alpha, (int, float))
            or not math.isfinite(alpha)
            or alpha <= 0
        ):
            p.append(f"lora.alpha must be a number > 0 (scale alpha / rank), got {alpha!r}")
        targets = resolve_targets(self.targets, gated=model.ffn_gated, problems=p)
        if rank is not None and targets:
            shapes = linear_shapes(model)
            narrow = {n: min(shapes[n]) for n in targets if rank > min(shapes[n])}
            if narrow:
                which = ", ".join(f"{n} ({shapes[n][0]} -> {shapes[n][1]})" for n in narrow)
                p.append(
                    f"lora.rank = {rank} is larger than the width of {which} in model "
                    f"{model.name!r}: a rank above min(in, out) adds nothing; use a rank <= "
                    f"{min(narrow.values())}"
                )
        if p or rank is None:
            raise SpecError(p)
        return dataclasses.replace(
            self, rank=rank, alpha=None if alpha is None else float(alpha), targets=targets
        )

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def shapes(self, model: "ModelSpec") -> tuple[tuple[int, int], ...]:
        """(in, out) of every adapted linear layer of one block."""
        shapes = linear_shapes(model)
        return tuple(shapes[n] for n in self.targets or ())

    def layer_params(self, model: "ModelSpec") -> int:
        """Adapter parameters of one block: rank x (in + out) per adapted linear layer."""
        return sum(self.rank * (i + o) for i, o in self.shapes(model))

    def short(self) -> str:
        return f"lora-r{self.rank}-" + "".join(_SHORT.get(t, t[0]) for t in self.targets or ())

    @property
    def adapted(self) -> frozenset[str]:
        """The separate projections that have an adapter (a fused target counts for each of
        its parts)."""
        return frozenset(p for t in self.targets or () for p in FUSED.get(t, (t,)))

    @classmethod
    def from_value(cls, value: Any, *, what: str) -> "LoraSpec":
        if isinstance(value, LoraSpec):
            return value
        if not isinstance(value, dict):
            raise SpecError(
                f"{what}: lora must be a mapping such as {{rank: 16, targets: [q, v]}}, "
                f"got {type(value).__name__}"
            )
        kwargs = check_keys(value, cls, what=f"{what}: lora", aliases={"r": "rank", "dim": "rank"})
        if "rank" not in kwargs:
            raise SpecError(f"{what}: lora lacks rank (the adapters' inner width, e.g. 16)")
        if isinstance(kwargs.get("targets"), list):
            kwargs["targets"] = tuple(kwargs["targets"])
        return cls(**kwargs)


def linear_shapes(model: "ModelSpec") -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one dense block, by target name."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q, kv = model.attention_hidden_size, model.kv_hidden_size
    out = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "up": (h, f), "down": (f, h)}
    out["qkv"] = (h, q + 2 * kv)
    if model.ffn_gated:
        out["gate"], out["gate_up"] = (h, f), (h, 2 * f)
    return out


def resolve_targets(
    targets: Any, *, gated: bool, problems: list[str] | None = None
) -> tuple[str, ...]:
    """`targets` (names, groups, or a comma-separated text) as a tuple of `LORA_TARGETS` in
    their order; None is every linear layer of the block. Unknown names go to `problems` (or
    raise a SpecError when it is None)."""
    p: list[str] = [] if problems is None else problems
    if targets is None:
        return tuple(t for t in SEPARATE if gated or t != "gate")
    if isinstance(targets, str):
        targets = [t for t in targets.split(",")]
    if not isinstance(targets, (list, tuple)) or not targets:
        p.append(
            f"lora.targets must be a non-empty list of {', '.join(LORA_TARGETS)} (or the groups "
            f"{', '.join(TARGET_GROUPS)}), got {targets!r}"
        )
        return ()
    chosen: set[str] = set()
    for name in targets:
        key = str(name).strip().lower()
        key = key if key in TARGET_GROUPS else key.removesuffix("_proj")
        if key in TARGET_GROUPS:
            group = TARGET_GROUPS[key]
            if not gated:
                group = tuple("up" if t == "gate_up" else t for t in group if t != "gate")
            chosen.update(group)
        elif key in ("gate", "gate_up") and not gated:
            p.append(
                f"lora.targets names {key}, but this model's MLP has no gate (ffn_activation "
                f"gelu or relu2: up and down only); drop {key}"
            )
        elif key in LORA_TARGETS:
            chosen.add(key)
        else:
            p.append(
                f"lora.targets: unknown target {name!r}; choose among {', '.join(LORA_TARGETS)} "
                f"or the groups {', '.join(TARGET_GROUPS)}"
            )
    for fused, parts in FUSED.items():
        both = sorted(chosen & set(parts))
        if fused in chosen and both:
            p.append(
                f"lora.targets names {fused} (one adapter on the fused matrix) and "
                f"{', '.join(both)} (adapters on its parts); choose one of the two"
            )
    if problems is None and p:
        raise SpecError(p)
    return tuple(t for t in LORA_TARGETS if t in chosen)
