"""A fingerprint of the cost model: one hash over many estimates, to show a restructure changed
no number.

    python tools/fingerprint.py [--target N] [--json]

Four spaces (the shipped ``default``, ``megatron`` as a frozen copy, today's full space of
`benchmarks/search_default.py --extended`, and a space with every recompute kind, N-layer
recompute, cp and uneven pipelines open) over four (model, cluster, global batch) cases, each
strategy scored under the ``torch`` and ``torchtitan`` runtimes (about `target` strategies
spread over each space, so that the largest spaces stay a few seconds). Mixture-of-experts
models have their own fingerprint (`MOE_CASES`: the default and megatron spaces, which open ep
and etp for them, under ``torch``, ``torchtitan`` and ``megatron-core``), so a change to the
expert terms shows without moving the dense one. Each estimate
contributes its strategy's fields and every number of its CostReport (floats by ``repr``:
bit-exact). Fields a later version
adds to Strategy or CostReport are left out of the hash while they keep their defaults, so the
fingerprint compares across versions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosearch.core.strategy import Strategy  # noqa: E402
from cost_models import AnalyticCostModel  # noqa: E402
from search_spaces import SearchSpace, SpaceConfig  # noqa: E402

CASES = (
    ("llama3-8b", "h100-sxm:1x8", 64),
    ("gpt3-13b", "a100-sxm4-80gb:4x8", 256),
    ("llama3-70b", "h100-sxm:8x8", 512),
    ("llama3.1-405b", "h200-sxm:32x8", 1024),
)
SPACES = {
    "default": lambda: SpaceConfig.default(),
    # frozen: the shipped megatron.yaml as it was when the space stopped being the tool's to
    # follow (Dec 2026, before it opened uneven pipelines), so that editing the shipped space
    # does not move the cost model's fingerprint
    "megatron": lambda: SpaceConfig.from_yaml(
        Path(__file__).with_name("fingerprint_megatron.yaml")
    ),
    "extended": lambda: SpaceConfig(
        cp=None,
        fp8=("none", "tensorwise", "rowwise"),
        compile=(False, True),
        async_tp=(False, True),
        uneven_pipeline=True,
    ),
    "recompute": lambda: SpaceConfig(
        cp=None, recompute=("none", "selective", "selective_op", "full"), uneven_pipeline=True
    ),
}
RUNTIMES = ("torch", "torchtitan")
MOE_CASES = (
    ("qwen3-30b-a3b", "h100-sxm:2x8", 256),
    ("mixtral-8x7b", "h100-sxm:4x8", 256),
    ("deepseek-v3", "h100-sxm:32x8", 2048),
)
MOE_SPACES = ("default", "megatron")
MOE_RUNTIMES = ("torch", "torchtitan", "megatron-core")
# The Strategy fields of the version that introduced this tool (Dec 2026); later fields are
# hashed only when they differ from their default.
BASE_FIELDS = (
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
    "cp",
    "recompute_num_layers",
    "pipeline_split",
    "fp8",
    "compile",
    "async_tp",
)
REPORT_FIELDS = (
    "step_time_s",
    "tokens_per_s",
    "samples_per_s",
    "model_flops_per_step",
    "tflops_per_gpu",
    "mfu",
    "peak_memory_bytes",
    "memory_capacity_bytes",
    "fits",
    "time",
    "memory",
)


def strategy_key(s: Strategy) -> str:
    default = Strategy()
    extra = sorted(
        (name, getattr(s, name))
        for name in s.to_dict()
        if name not in BASE_FIELDS and getattr(s, name) != getattr(default, name)
    )
    return repr(tuple(getattr(s, name) for name in BASE_FIELDS) + tuple(extra))


def report_key(r) -> str:
    return repr(tuple(_plain(getattr(r, name)) for name in REPORT_FIELDS))


def _plain(value):
    """A breakdown as a plain tuple, without the fields a later version added while they keep
    their defaults (TimeBreakdown's offload_s)."""
    if not isinstance(value, tuple):
        return value
    defaults = getattr(value, "_field_defaults", {})
    fields = getattr(value, "_fields", ())
    return tuple(
        v
        for name, v in zip(fields or range(len(value)), value)
        if name not in defaults or v != defaults[name]
    )


def sampled(space: SearchSpace, target: int):
    """About `target` strategies spread over the space: every k-th layout, every j-th strategy
    of its group (enumerating 14 M strategies to keep a few thousand would take minutes); for
    full recompute without a pipeline, its 1-layer variant too."""
    layouts = list(space.layouts())
    k = max(1, len(layouts) // 250)
    chosen = layouts[::k]
    group = getattr(space, "strategies_of", None) or space._group
    per_group = max(1, space.size // len(layouts))
    j = max(1, per_group * len(chosen) // target)
    for layout in chosen:
        for i, s in enumerate(group(layout)):
            if i % j:
                continue
            yield s
            if s.recompute == "full" and s.pp == 1:
                yield s.replace(recompute_num_layers=1)


def fingerprint(target: int, moe: bool = False) -> dict:
    """The hash of about `target` estimates per (case, space, runtime): the dense cases, or
    with `moe` the mixture-of-experts ones."""
    cases, spaces = (MOE_CASES, MOE_SPACES) if moe else (CASES, tuple(SPACES))
    runtimes = MOE_RUNTIMES if moe else RUNTIMES
    digest, per_part, n = hashlib.sha256(), {}, 0
    t0 = time.perf_counter()
    for model, cluster, gbs in cases:
        for space_name in spaces:
            config = SPACES[space_name]()
            space = SearchSpace(model, cluster, global_batch_size=gbs, config=config)
            for runtime in runtimes:
                cm = AnalyticCostModel(space.model, space.cluster, runtime=runtime)
                part = hashlib.sha256()
                for s in sampled(space, target):
                    line = f"{strategy_key(s)}|{report_key(cm.estimate(s, validate=False))}\n"
                    part.update(line.encode())
                    digest.update(line.encode())
                    n += 1
                per_part[f"{model}|{cluster}|{space_name}|{runtime}"] = part.hexdigest()[:16]
    return {
        "estimates": n,
        "target": target,
        "fingerprint": digest.hexdigest(),
        "parts": per_part,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=4000, help="strategies per part")
    parser.add_argument("--json", action="store_true", help="every part's hash too")
    args = parser.parse_args()
    dense, moe = fingerprint(args.target), fingerprint(args.target // 4, moe=True)
    if args.json:
        print(json.dumps({**dense, "moe": moe}, indent=2))
    else:
        for label, out in (("", dense), ("MoE: ", moe)):
            n, digest = out["estimates"], out["fingerprint"]
            print(f"{label}{n:,} estimates, fingerprint {digest} ({out['seconds']} s)")


if __name__ == "__main__":
    main()
