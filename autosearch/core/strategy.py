"""Strategy: how one training step is split over the devices of a cluster.

Example:
    >>> from autosearch import Strategy
    >>> s = Strategy.parse("dp=8,tp=8,pp=4,micro_batch_size=2,global_batch_size=512")
    >>> s.grad_accum_steps
    32
    >>> Strategy.from_yaml(s.to_yaml()) == s
    True
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from autosearch.core import dimensions, rules
from autosearch.core._io import check_keys, parse_yaml_mapping, positive_int, read_yaml_mapping
from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec

# The legal values of the choice dimensions (declared in `autosearch.core.dimensions`).
PIPELINE_SCHEDULES = dimensions.BY_NAME["pipeline_schedule"].choices
RECOMPUTE = dimensions.BY_NAME["recompute"].choices
AMP = dimensions.BY_NAME["amp"].choices
FP8 = dimensions.BY_NAME["fp8"].choices
ZERO_STAGES = dimensions.BY_NAME["zero_stage"].choices
# Paddle calls tensor parallel "mp"; accepted at the edges (YAML, CLI), never used inside.
ALIASES = {
    "mp": "tp",
    "mp_degree": "tp",
    "dp_degree": "dp",
    "pp_degree": "pp",
    "sharding_stage": "zero_stage",
}
# First line of every strategy file autosearch writes: such a file must hold every field, so that a
# file cut short (a full disk, a killed writer) is refused instead of read with defaults.
MARKER = "# autosearch strategy"
# The fields such a file always holds (those added later, cp, fp8 ..., keep their defaults when
# an older file lacks them).
FILE_FIELDS = tuple(d.name for d in dimensions.DIMENSIONS if d.file)
_BOOL_WORDS = {
    "true": True,
    "false": False,
    "yes": True,
    "no": False,
    "on": True,
    "off": False,
    "1": True,
    "0": False,
}


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """A parallel training strategy. Every field has a default, so a file names only what differs
    (and its degrees dp, tp, pp, which a file must always name).

    Args:
        dp: data-parallel degree (replicas, or shards with ZeRO).
        tp: tensor-parallel degree (Megatron-style column/row split of every block).
        pp: pipeline-parallel degree (stages).
        micro_batch_size: sequences per micro-batch on one data-parallel rank.
        global_batch_size: sequences per optimizer step over the whole cluster; defaults to
            ``dp * micro_batch_size``.
        pipeline_schedule: ``gpipe``, ``1f1b`` or ``interleaved_1f1b``.
        virtual_stages: model chunks per pipeline rank (> 1 only with ``interleaved_1f1b``).
        recompute: activation recompute, ``none``, ``selective`` (attention core) or ``full``.
        sequence_parallel: shard norms/dropout activations over tp (Korthikanti et al. 2022).
        zero_stage: ZeRO sharding over dp: 1 optimizer states, 2 + gradients, 3 + parameters.
        amp: compute precision, ``fp32``, ``fp16`` or ``bf16``.
        cp: context-parallel degree: the sequence split over cp ranks, attention by ring
            exchange of keys and values (torch's context parallel; Liu et al. 2023).
        recompute_num_layers: with ``recompute: full``, recompute only this many layers of
            each pipeline chunk (Megatron-LM ``--recompute-num-layers`` with the block method);
            ``None`` means every layer.
        pipeline_split: layers of each pipeline chunk, in order (``pp * virtual_stages``
            numbers summing to the layers; ``15/16/16/15`` on the command line); ``None``
            splits them as evenly as possible, the first and last chunks taking one layer less
            when the division is uneven (they also hold the embedding and the logits).
        fp8: float8 matmuls in the transformer blocks, ``none``, ``tensorwise`` or ``rowwise``
            (needs a GPU with fp8 units); the compute precision of the rest stays `amp`.
        compile: the runtime compiles each block (``torch.compile``): elementwise work fuses.
        async_tp: tensor-parallel collectives overlap the matmuls (micro-pipelined TP).
        ep: expert-parallel degree (the routed experts split over ep groups).
        etp: expert-tensor-parallel degree (each expert split over etp of the tp ranks).
        recompute_modules: Megatron-Core's per-module recompute of a mixture-of-experts
            model beyond the attention core (``layernorm+moe_act``, ``layernorm+moe``,
            ``mla_up_proj+mlp`` ...; `dimensions.RECOMPUTE_MODULE_SETS`), or ``none``.
        offload_optimizer: optimizer states and the optimizer step on the host (ZeRO-Offload).
        offload_params: with ZeRO-3 / FSDP, the parameter shards on the host (ZeRO-Infinity,
            FSDP2 ``CPUOffloadPolicy``); needs `offload_optimizer`.
        offload_activations: ``none``, or ``layers``: every tensor a layer saves for
            backward kept on the host (``torch.autograd.graph.save_on_cpu``).
    """

    dp: int = dimensions.field("dp")
    tp: int = dimensions.field("tp")
    pp: int = dimensions.field("pp")
    micro_batch_size: int = dimensions.field("micro_batch_size")
    # None: dp * micro_batch_size
    global_batch_size: int = dimensions.field("global_batch_size")
    pipeline_schedule: str = dimensions.field("pipeline_schedule")
    virtual_stages: int = dimensions.field("virtual_stages")
    recompute: str = dimensions.field("recompute")
    sequence_parallel: bool = dimensions.field("sequence_parallel")
    zero_stage: int = dimensions.field("zero_stage")
    amp: str = dimensions.field("amp")
    cp: int = dimensions.field("cp")
    recompute_num_layers: int | None = dimensions.field("recompute_num_layers")
    pipeline_split: tuple[int, ...] | None = dimensions.field("pipeline_split")
    fp8: str = dimensions.field("fp8")
    compile: bool = dimensions.field("compile")
    async_tp: bool = dimensions.field("async_tp")
    ep: int = dimensions.field("ep")
    etp: int = dimensions.field("etp")
    recompute_modules: str = dimensions.field("recompute_modules")
    offload_optimizer: bool = dimensions.field("offload_optimizer")
    offload_params: bool = dimensions.field("offload_params")
    offload_activations: str = dimensions.field("offload_activations")

    def __post_init__(self) -> None:
        """Check every field by its kind (`autosearch.core.dimensions`)."""
        problems = []
        for name in _INTEGERS:
            try:
                object.__setattr__(self, name, positive_int(getattr(self, name), name))
            except SpecError as exc:
                problems.append(str(exc))
        if self.global_batch_size is None:
            if not problems:
                object.__setattr__(self, "global_batch_size", self.dp * self.micro_batch_size)
        else:
            try:
                object.__setattr__(
                    self,
                    "global_batch_size",
                    positive_int(self.global_batch_size, "global_batch_size"),
                )
            except SpecError as exc:
                problems.append(str(exc))
        for name, choices in _CHOICES:
            value = getattr(self, name)
            if value not in choices or isinstance(value, bool):
                problems.append(f"{name} must be {_one_of(choices)}; got {value!r}")
            elif isinstance(value, float):  # zero_stage 1.0 is stage 1: an integer stays one
                object.__setattr__(self, name, choices[choices.index(value)])
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false; got {getattr(self, name)!r}")
        for name in _COUNTS:
            if getattr(self, name) is not None:
                try:
                    object.__setattr__(self, name, positive_int(getattr(self, name), name))
                except SpecError as exc:
                    problems.append(str(exc))
        for name in _SPLITS:
            split = getattr(self, name)
            if split is None:
                continue
            if isinstance(split, int) and not isinstance(split, bool):  # one chunk
                split = (split,)
            if isinstance(split, str):  # "15/16/16/15" from the command line
                parts = split.replace("/", ",").split(",")
                split = tuple(int(p) if p.strip().isdigit() else p for p in parts if p.strip())
            try:
                # an empty chunk (0) holds only the embedding, the loss or the MTP modules, as
                # in Megatron-Core's --pipeline-model-parallel-layout ("E|t*4|...|mL")
                split = tuple(positive_int(n, f"{name} entry", minimum=0) for n in split)
                object.__setattr__(self, name, split)
            except (SpecError, TypeError) as exc:
                problems.append(f"{name} must be a list of layer counts: {exc}")
        if problems:
            raise SpecError(problems, context="invalid strategy")

    def with_checked(self, values: Mapping[str, Any]) -> "Strategy":
        """This strategy with `values` replaced, unchecked: for values that a `Strategy` has
        already held (the search space builds ~400 strategies per layout that differ from the
        first only in values it has checked; `__post_init__` is a quarter of that work)."""
        new = object.__new__(Strategy)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(values)
        return new

    # ---- derived --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The devices: the product of the mesh degrees (dp, tp, pp, cp; folded ones add none)."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on a data-parallel rank (pipeline micro-batches)."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    def layers_per_chunk(self, n_layers: int) -> tuple[int, ...]:
        """Layers of each pipeline chunk, in pipeline order (`pipeline_split`, or the even split
        of `autosearch.core.rules.split_layers`)."""
        if self.pipeline_split is not None:
            return self.pipeline_split
        return rules.split_layers(n_layers, self.pp * self.virtual_stages)

    @property
    def n_microbatches(self) -> int:
        return self.grad_accum_steps

    # ---- checks against a model and a cluster ---------------------------------------------------
    def problems(
        self, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None
    ) -> list[str]:
        """Every rule this strategy breaks for this model and cluster, each with its fix.

        Without a model (a user's own network), only the rules that hold for any model are checked;
        without a cluster, the world size is not.
        """
        return rules.problems(self.__dict__, model, cluster)

    def validate(self, model: "ModelSpec", cluster: "Cluster | None" = None) -> "Strategy":
        """Raise SpecError naming every violated rule and its fix; return self if valid."""
        problems = self.problems(model, cluster)
        if problems:
            raise SpecError(
                problems, context=f"strategy {self.short()} is invalid for {model.name}"
            )
        return self

    # ---- text forms ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.pipeline_split is not None:
            out["pipeline_split"] = list(self.pipeline_split)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, what: str = "strategy") -> "Strategy":
        from autosearch.core.schema import read_mapping

        data = read_mapping(data, what, fix="a mapping of its fields (e.g. {dp: 8, tp: 2})")
        kwargs = check_keys(data, cls, what=what, aliases=ALIASES)
        for key, _ in _CHOICES:
            if key in kwargs and isinstance(kwargs[key], str):
                kwargs[key] = kwargs[key].lower()
        if kwargs.get("recompute") is False:  # YAML reads `recompute: no` as a bool
            kwargs["recompute"] = "none"
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, source: "str | os.PathLike") -> "Strategy":
        """Load from a YAML file path, or from YAML text (anything containing a newline or ':')."""
        text = os.fspath(source)
        if "\n" in text or (":" in text and not os.path.exists(text)):
            return cls.from_dict(
                parse_yaml_mapping(text, what="strategy YAML"), what="strategy YAML"
            )
        data = read_yaml_mapping(text, what="strategy")
        what = f"strategy file {text!r}"
        complete = _has_marker(text)  # written whole by autosearch: every field must be there
        if "strategy" in data and isinstance(data["strategy"], dict):  # a file written by tune
            data, complete = data["strategy"], True
        if not data:
            raise SpecError(
                f"{what} is empty; write the fields that differ from the defaults "
                "(for example `dp: 8`, `tp: 8`), or pass key=value pairs"
            )
        if complete:
            missing = [name for name in FILE_FIELDS if name not in data]
            if missing:
                raise SpecError(
                    f"{what} was written by autosearch but lacks {', '.join(missing)}: the file "
                    "looks truncated; write it again (autosearch tune, or Strategy.to_yaml)"
                )
        named = {ALIASES.get(str(k), str(k)) for k in data}
        degrees = [d for d in ("dp", "tp", "pp") if d not in named]
        if degrees:
            raise SpecError(
                f"{what} does not name {', '.join(degrees)}: a strategy file names its parallel "
                "degrees (dp * tp * pp [* cp] = the devices), e.g. `dp: 8`, `tp: 1`, `pp: 1`"
            )
        return cls.from_dict(data, what=what)

    def to_yaml(
        self, path: "str | os.PathLike | None" = None, *, comment: str | None = None
    ) -> str:
        text = MARKER + "\n" + yaml.safe_dump(self.to_dict(), sort_keys=False)
        if comment:
            text = "".join(f"# {line}\n" for line in comment.splitlines()) + text
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Parse ``"dp=8,tp=8,pp=4,recompute=full"`` (the CLI form), or a YAML file path."""
        if not isinstance(text, str):
            raise TypeError(
                f"a strategy is a Strategy, a dict or a string; got {type(text).__name__}"
            )
        if not text.strip():
            raise SpecError(
                "the strategy is empty; give key=value pairs (for example dp=8,tp=8) or a YAML"
                " file"
            )
        if os.path.exists(text) or text.endswith((".yaml", ".yml")):
            return cls.from_yaml(text)
        data: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            if "=" not in item:
                raise SpecError(
                    f'strategy item {item!r} is not key=value (example: "dp=8,tp=8,pp=4")'
                )
            key, value = (s.strip() for s in item.split("=", 1))
            if key in data:
                raise SpecError(
                    f"strategy {text!r} gives {key!r} twice ({key}={data[key]} and {item}); "
                    "give each key once"
                )
            data[key] = _parse_scalar(value)
        return cls.from_dict(data, what=f"strategy {text!r}")

    def short(self) -> str:
        """A compact one-line label, e.g. ``dp8-tp8-pp4-mb2-gbs512-1f1b-rc-full-sp-z1-bf16``."""
        return dimensions.short_label(self)

    def replace(self, **changes: Any) -> "Strategy":
        return dataclasses.replace(self, **changes)


dimensions.check_fields(Strategy)
_KINDS = {d.name: d.kind for d in dimensions.DIMENSIONS}
_INTEGERS = tuple(n for n, k in _KINDS.items() if k in (dimensions.DEGREE, dimensions.SIZE))
_CHOICES = tuple((d.name, d.choices) for d in dimensions.DIMENSIONS if d.kind == dimensions.CHOICE)
_FLAGS = tuple(n for n, k in _KINDS.items() if k == dimensions.FLAG)
_COUNTS = tuple(n for n, k in _KINDS.items() if k == dimensions.COUNT)
_SPLITS = tuple(n for n, k in _KINDS.items() if k == dimensions.SPLIT)


def _one_of(choices: tuple[Any, ...]) -> str:
    """``one of gpipe, 1f1b`` for names; ``0, 1, 2 or 3`` for numbers."""
    if all(isinstance(c, int) for c in choices):
        return ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}"
    return "one of " + ", ".join(map(str, choices))


def _parse_scalar(value: str) -> Any:
    low = value.lower()
    if low in _BOOL_WORDS and low not in ("1", "0"):
        return _BOOL_WORDS[low]
    try:
        return int(value)
    except ValueError:
        return value


def _has_marker(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return any(line.strip() == MARKER for line in f.read(4096).splitlines())
    except OSError:
        return False
