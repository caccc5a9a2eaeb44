"""Offload to host memory (issue 36): the figures the closing note reports.

1. The host's Adam rate: torch.optim.AdamW (fused and foreach) on fp32 CPU tensors, one thread,
   parameters per second per core (the `torch` preset's `host_adam_params_per_s_per_core`,
   cost_models/runtimes.yaml, is this measurement).
2. The 70B-on-one-node case, `tune --model llama3-70b --cluster h100-sxm:1x8
   --global-batch-size 32 --seq-len 4096` (and on two nodes at global batch 16), with offload
   kept out of the space (before issue 36) and as the default space opens it: the pick,
   tokens/s, device and host memory, search time.
3. One offloaded strategy across platforms: PCIe 4 / PCIe 5 hosts and Grace over NVLink-C2C.
4. Published offload runs scored (benchmarks/reference/sharded_dp_runs.csv, `offload` column),
   and those that cannot be, with why.

Run: python benchmarks/offload.py [--skip-tune]   (writes results/offload.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from fidelity_scale import eq3_flops  # noqa: E402

from autosearch import Cluster, ModelSpec, Strategy  # noqa: E402
from cost_models import AnalyticCostModel  # noqa: E402

GiB = float(1 << 30)
NO_OFFLOAD = {"offload_optimizer": False, "offload_params": False, "offload_activations": "none"}


def adam_rate(n_params: int = 16_000_000, repeats: int = 5) -> dict:
    """Parameters per second of one AdamW step on one CPU thread, fused and foreach."""
    import torch

    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(n_params // 16)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    out = {}
    for kind in ("fused", "foreach"):
        opt = torch.optim.AdamW(params, lr=1e-3, **{kind: True})
        opt.step()
        t0 = time.perf_counter()
        for _ in range(repeats):
            opt.step()
        out[kind] = n_params * repeats / (time.perf_counter() - t0)
    return out


def seventy_b(cluster: str = "h100-sxm:1x8", global_batch_size: int = 32) -> dict:
    from autosearch.tuning import NoFeasibleStrategyError
    from autosearch.tuning._study import tune

    case = dict(
        model="llama3-70b", cluster=cluster, global_batch_size=global_batch_size, seq_len=4096
    )
    out = {}
    for name, space in (("without offload", NO_OFFLOAD), ("default space", None)):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            try:
                r = tune(
                    case["model"],
                    case["cluster"],
                    global_batch_size=case["global_batch_size"],
                    seq_len=case["seq_len"],
                    seed=0,
                    out=tmp,
                    space=space,
                )
            except NoFeasibleStrategyError as exc:
                r = exc.result
            seconds = time.perf_counter() - t0
        row: dict = {"space_size": r.space.size, "search_s": seconds}
        if r.best_strategy is None:
            least = r.least_hungry
            row["pick"] = None
            row["least_hungry_gib"] = least.report.peak_memory_bytes / GiB if least else None
        else:
            rep = r.best_report
            row.update(
                pick=r.best_strategy.short(),
                tokens_per_s=rep.tokens_per_s,
                device_gib=rep.peak_memory_bytes / GiB,
                host_gib_per_node=rep.host_memory_bytes / GiB,
                offload_s=rep.time.offload_s,
                optimizer_s=rep.time.optimizer_s,
            )
        out[name] = row
    return out


def platforms() -> list[dict]:
    """llama3-70b at seq 4096, ZeRO-3 over 8 GPUs with everything offloaded, per platform."""
    model = ModelSpec.load("llama3-70b", seq_len=4096)
    s = Strategy(
        dp=8,
        global_batch_size=32,
        zero_stage=3,
        recompute="full",
        offload_optimizer=True,
        offload_params=True,
        offload_activations="layers",
    )
    rows = []
    for cluster in ("a100-sxm4-80gb:1x8", "h100-sxm:1x8", "b200-sxm:1x8", "gb200-nvl72:2x4"):
        c = Cluster.parse(cluster)
        r = AnalyticCostModel(model, c).estimate(s)
        rows.append(
            {
                "cluster": cluster,
                "host_link": c.profile.host.link,
                "tokens_per_s": r.tokens_per_s,
                "offload_s": r.time.offload_s,
                "optimizer_s": r.time.optimizer_s,
                "step_s": r.step_time_s,
                "device_gib": r.peak_memory_bytes / GiB,
                "host_gib_per_node": r.host_memory_bytes / GiB,
            }
        )
    return rows


def saved_census(micro_batch: int = 2) -> list[dict]:
    """What ``save_on_cpu`` moves for one block of the Engine's reference transformer (a Llama
    shape at hidden 512, seq 512, on this CPU): every saved tensor is packed, and copied, once
    per save (q, k and v each save their input), against the bytes the block keeps (each
    storage once) and the cost model's figure for one layer (`LayerActivations.kept_bytes`,
    priced for an H100 with the Engine's runtime: flash attention)."""
    import torch

    from autosearch.models.transformer import Transformer

    spec = ModelSpec.load("llama3-8b").scaled(
        n_layers=2, hidden_size=512, n_heads=8, n_kv_heads=4, ffn_hidden_size=1536,
        vocab_size=1024, seq_len=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(spec)
    tokens = torch.randint(0, spec.vocab_size, (micro_batch, spec.seq_len))
    cm = AnalyticCostModel(spec, Cluster.parse("h100-sxm:1x8"))
    rows = []
    for amp in ("fp32", "bf16"):
        seen: set = set()
        count = {"packed": 0, "unique": 0}

        def pack(t, seen=seen, count=count):
            nbytes = t.numel() * t.element_size()
            count["packed"] += nbytes
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                count["unique"] += nbytes
            return t

        h = model.tok_embeddings(tokens).detach().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
                model.layers["0"](h)
        s = Strategy(
            dp=8, micro_batch_size=micro_batch, global_batch_size=8 * micro_batch, amp=amp
        )
        rows.append(
            {
                "amp": amp,
                "copied_mib": count["packed"] / 2**20,
                "kept_mib": count["unique"] / 2**20,
                "copies_per_kept_byte": count["packed"] / count["unique"],
                "model_mib": cm._activations(s).kept_bytes / 2**20,
            }
        )
    return rows


# Published runs that offloaded: (row id, strategy fields beyond the row's, why any is assumed)
SCORED = {
    "DSAZURE-175B-256-SEQ512": {
        "offload_optimizer": True,
        "offload_activations": "layers",
        "recompute": "full",
        "amp": "bf16",
    },
}
NOT_SCORED = {
    "DSAZURE-530B-1024-SEQ1024": "the micro-batch of the peak and the global batch are not "
    "stated: the host's optimizer step per step cannot be priced without them",
    "DSAZURE-1T-1024-MB8": "global batch not stated (the host optimizer step is per step)",
    "DSAZURE-2T-1024-MB8": "global batch not stated (the host optimizer step is per step)",
    "ZeRO-Offload (Ren et al. 2021) 10B on one V100 at 40 TFLOP/s": "no V100 profile",
    "ZeRO-Infinity (Rajbhandari et al. 2021) DGX-2 runs": "no V100 / DGX-2 profile; NVMe offload "
    "is not a dimension",
    "MZOO-QWEN3-235B-GB200-MXFP8-4K-64N (Megatron-MoE Model Zoo)": "fine-grained activation "
    "offload of module inputs (--offload-modules) is not priced; the whole-layer offload is "
    "not what it ran",
}


def published() -> list[dict]:
    import pandas as pd

    table = pd.read_csv(HERE / "reference" / "sharded_dp_runs.csv").set_index("id")
    rows = []
    for rid, extra in SCORED.items():
        row = table.loc[rid]
        # GPT 175B as SC'21 Table 1 (96 x 12288, 96 heads, vocabulary 51,200, tied)
        l, h, a, V = 96, 12288, 96, 51200
        s, gpus = int(row.seq_len), int(row.n_gpus)
        mb, gbs = int(row.micro_batch_size), int(row.global_batch_size)
        model = ModelSpec(
            name=rid, n_layers=l, hidden_size=h, n_heads=a, vocab_size=V, seq_len=s,
            tied_embeddings=True,
        )  # fmt: skip
        cluster = Cluster(gpu=row.gpu, n_nodes=gpus // 8, gpus_per_node=8)
        strategy = Strategy(
            dp=gpus, micro_batch_size=mb, global_batch_size=gbs, zero_stage=3, **extra
        )
        # DeepSpeed offloads the checkpointed layer inputs (activation_checkpointing.
        # cpu_checkpointing): offload_activations=layers under full recompute prices exactly
        # those; the deepspeed preset does not list the feature (without recompute DeepSpeed
        # has no activation offload), so the row is priced unchecked
        r = AnalyticCostModel(model, cluster, runtime="deepspeed").estimate(
            strategy, validate=False
        )
        predicted = eq3_flops(gbs, s, l, h, V) / (r.step_time_s * gpus) / 1e12
        rows.append(
            {
                "id": rid,
                "strategy": strategy.short(),
                "runtime": "deepspeed",
                "published_tflops_per_gpu": float(row.published),
                "predicted_tflops_per_gpu": predicted,
                "error": predicted / float(row.published) - 1,
                "fits": r.fits,
                "device_gib": r.peak_memory_bytes / GiB,
                "host_gib_per_node": r.host_memory_bytes / GiB,
                "offload_s": r.time.offload_s,
                "optimizer_s": r.time.optimizer_s,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tune", action="store_true", help="leave out the 70B searches")
    parser.add_argument("--out", default=str(ROOT / "results" / "offload.json"))
    args = parser.parse_args()
    result: dict = {}
    rate = adam_rate()
    result["host_adam_params_per_s_per_core"] = rate
    print("host AdamW, one core: " + ", ".join(f"{k} {v / 1e6:,.0f} M/s" for k, v in rate.items()))
    if not args.skip_tune:
        # one node: the floor says nothing fits; two nodes at batch 16: the floor fits the
        # device but none of the leanest strategies does
        for cluster, gbs in (("h100-sxm:1x8", 32), ("h100-sxm:2x8", 16)):
            key = f"llama3-70b {cluster} gbs{gbs} seq4096"
            result[key] = case = seventy_b(cluster, gbs)
            for name, row in case.items():
                print(f"70B {cluster} gbs {gbs}, {name}: " + json.dumps(row, default=str))
    result["platforms"] = rows = platforms()
    for row in rows:
        print(
            f"{row['cluster']:<20} {row['host_link']:<11} {row['tokens_per_s']:8,.0f} tok/s  "
            f"copies {row['offload_s']:6.2f} s  host Adam {row['optimizer_s']:5.2f} s  "
            f"device {row['device_gib']:5.1f} GiB  host {row['host_gib_per_node']:7.1f} GiB/node"
        )
    result["save_on_cpu_census"] = census = saved_census()
    for row in census:
        print(
            f"save_on_cpu, one reference block, {row['amp']}: copies {row['copied_mib']:.1f} "
            f"MiB for {row['kept_mib']:.1f} MiB kept (x{row['copies_per_kept_byte']:.2f}); "
            f"the cost model's layer: {row['model_mib']:.1f} MiB"
        )
    result["published"] = scored = published()
    for row in scored:
        print(
            f"{row['id']}: {row['strategy']} predicted {row['predicted_tflops_per_gpu']:.1f} vs "
            f"published {row['published_tflops_per_gpu']:.1f} TFLOP/s ({row['error']:+.1%})"
        )
    result["not_scored"] = NOT_SCORED
    for rid, why in NOT_SCORED.items():
        print(f"not scored: {rid}: {why}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
