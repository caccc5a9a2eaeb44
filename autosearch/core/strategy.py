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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from autosearch.core import rules
from autosearch.core._io import check_keys, parse_yaml_mapping, positive_int, read_yaml_mapping
from autosearch.core.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from autosearch.core.hardware import Cluster
    from autosearch.core.model_spec import ModelSpec

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# none; selective = the attention core (Korthikanti et al. 2022, sec. 5); selective_op = save the
# matmul outputs, recompute everything else (torchtitan's default "selective op" AC); full = each
# layer's whole forward (Chen et al. 2016), on every layer or on `recompute_num_layers` per stage.
RECOMPUTE = ("none", "selective", "selective_op", "full")
AMP = ("fp32", "fp16", "bf16")
# Float8 linears with a scale per tensor (torchao tensorwise; TransformerEngine delayed and
# current scaling are per-tensor scales too) or per row (torchao rowwise).
FP8 = ("none", "tensorwise", "rowwise")
ZERO_STAGES = (0, 1, 2, 3)
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
FILE_FIELDS = (
    "dp",
    "tp",
    "pp",
    "micro_batch_size",
    "global_batch_size",
    "pipeline_schedule",
    "virtual_stages",
    "recompute",
    "sequence_parallel",
    "zero_stage",
    "amp",
)
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
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = None  # type: ignore[assignment]  # None: dp * micro_batch_size
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    zero_stage: int = 0
    amp: str = "bf16"
    cp: int = 1
    recompute_num_layers: int | None = None
    pipeline_split: tuple[int, ...] | None = None
    fp8: str = "none"
    compile: bool = False
    async_tp: bool = False

    def __post_init__(self) -> None:
        problems = []
        for name in ("dp", "tp", "pp", "micro_batch_size", "virtual_stages", "cp"):
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
        for name, choices in (
            ("pipeline_schedule", PIPELINE_SCHEDULES),
            ("recompute", RECOMPUTE),
            ("amp", AMP),
            ("fp8", FP8),
        ):
            value = getattr(self, name)
            if value not in choices:
                problems.append(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            problems.append(f"zero_stage must be 0, 1, 2 or 3; got {self.zero_stage!r}")
        for name in ("sequence_parallel", "compile", "async_tp"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false; got {getattr(self, name)!r}")
        if self.recompute_num_layers is not None:
            try:
                n = positive_int(self.recompute_num_layers, "recompute_num_layers")
                object.__setattr__(self, "recompute_num_layers", n)
            except SpecError as exc:
                problems.append(str(exc))
        if self.pipeline_split is not None:
            split = self.pipeline_split
            if isinstance(split, int) and not isinstance(split, bool):  # one chunk
                split = (split,)
            if isinstance(split, str):  # "15/16/16/15" from the command line
                parts = split.replace("/", ",").split(",")
                split = tuple(int(p) if p.strip().isdigit() else p for p in parts if p.strip())
            try:
                split = tuple(positive_int(n, "pipeline_split entry") for n in split)
                object.__setattr__(self, "pipeline_split", split)
            except (SpecError, TypeError) as exc:
                problems.append(f"pipeline_split must be a list of layer counts: {exc}")
        if problems:
            raise SpecError(problems, context="invalid strategy")

    # ---- derived --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
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
        dp, tp, pp, v, cp = self.dp, self.tp, self.pp, self.virtual_stages, self.cp
        seq_len = model.seq_len if model is not None else None
        n_layers = model.n_layers if model is not None else None
        batch = rules.batch_problem(self.global_batch_size, dp, self.micro_batch_size)
        if self.pipeline_split is not None:
            layers = rules.pipeline_split_problem(self.pipeline_split, pp, v, n_layers)
        elif model is not None:
            layers = rules.layers_problem(pp, v, model, uneven=True)
        else:
            layers = None
        chunks = self.layers_per_chunk(n_layers) if layers is None and n_layers else None
        checks = [
            (
                rules.world_size_problem(
                    dp,
                    tp,
                    pp,
                    cp=cp,
                    devices=cluster.world_size,
                    where=f" ({cluster.n_nodes} nodes x {cluster.gpus_per_node})",
                )
                if cluster is not None
                else None
            ),
            rules.tp_problem(tp, model) if model is not None else None,
            layers,
            batch,
            rules.sequence_parallel_problem(
                self.sequence_parallel, tp, seq_len // cp if seq_len is not None else None
            ),
            rules.context_parallel_problem(cp, seq_len),
            rules.schedule_problem(self.pipeline_schedule, pp, v),
            # the micro-batch count is defined only when the batch splits
            (
                rules.microbatch_problem(pp, self.grad_accum_steps, self.pipeline_schedule)
                if batch is None
                else None
            ),
            rules.recompute_layers_problem(
                self.recompute, self.recompute_num_layers, min(chunks) if chunks else None
            ),
            rules.fp8_problem(self.fp8, cluster.profile.peak_flops if cluster else None),
            rules.async_tp_problem(self.async_tp, tp),
        ]
        return [problem for problem in checks if problem is not None]

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
        kwargs = check_keys(data, cls, what=what, aliases=ALIASES)
        for key in ("recompute", "pipeline_schedule", "amp", "fp8"):
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
        """A compact one-line label, e.g. ``dp8-tp8-pp4-mb2-gbs512-1f1b-rcfull-sp-z1-bf16``."""
        parts = [
            f"dp{self.dp}",
            f"tp{self.tp}",
            f"pp{self.pp}",
            f"mb{self.micro_batch_size}",
            f"gbs{self.global_batch_size}",
        ]
        if self.pp > 1:
            parts.append(
                self.pipeline_schedule
                + (f"v{self.virtual_stages}" if self.virtual_stages > 1 else "")
            )
        if self.recompute != "none":
            layers = f"{self.recompute_num_layers}" if self.recompute_num_layers else ""
            parts.append(f"rc-{self.recompute}{layers}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.zero_stage:
            parts.append(f"z{self.zero_stage}")
        if self.cp > 1:
            parts.insert(3, f"cp{self.cp}")
        if self.pipeline_split is not None:
            parts.append("split" + "_".join(map(str, self.pipeline_split)))
        parts.append(self.amp)
        if self.fp8 != "none":
            parts.append(f"fp8{self.fp8}")
        if self.compile:
            parts.append("compile")
        if self.async_tp:
            parts.append("asynctp")
        return "-".join(parts)

    def replace(self, **changes: Any) -> "Strategy":
        return dataclasses.replace(self, **changes)


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
