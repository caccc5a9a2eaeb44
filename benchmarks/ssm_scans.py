"""The Engine's Mamba-2 and Gated DeltaNet mixers (autosearch/models/ssm.py) against their
step-by-step recurrences and transformers' own torch paths: errors and CPU times.

For each mixer kind, on one CPU-sized shape:

- scan error: the chunked scan (`ssd_scan`, `chunk_gated_delta_rule`) against the recurrence
  (written here as in tests/test_ssm.py), max |difference| in float64 and in float32;
- mixer error: the whole mixer against transformers' (``NemotronHMamba2Mixer``,
  ``Qwen3NextGatedDeltaNet``; torch path, the same weights), max |difference| in float32;
- time: forward + backward of the mixer, ours and transformers', and of the recurrence alone,
  median of 5 runs after 1 warm-up, one thread (--threads);
- the scan alone (fp32, forward + backward) measured, next to what the cost model predicts for
  it under the Engine's runtime (``ssm_scan: torch_chunked``: `MambaSpec.torch_scan` /
  `GatedDeltaNetSpec.torch_scan` priced by `cost_models.terms.ssm.torch_scan_s`) on a CPU
  profile (--profile, default the committed calibration results/calibration/
  example-amd-epyc-2c-np1.yaml: an AMD EPYC, 2 threads a process). That profile is another
  CPU than the one this may run on, at another thread count; CPU times say how the op-by-op
  roofline does on a CPU, not what a GPU does.

Run: python benchmarks/ssm_scans.py [--seq 512]
Prints a table and writes results/ssm_scans.csv. Tests assert the errors (tests/test_ssm.py);
this only reports them and the times.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ssd_recurrence(x, dt, A, B, C):
    import torch

    batch, seq, heads, p = x.shape
    rep = heads // B.shape[2]
    B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    h = x.new_zeros(batch, heads, p, B.shape[-1])
    ys = []
    for t in range(seq):
        h = (
            torch.exp(dt[:, t] * A)[..., None, None] * h
            + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        )
        ys.append((h * C[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, dim=1)


def _delta_recurrence(q, k, v, g, beta):
    import torch

    batch, seq, heads, d_k = k.shape
    S = q.new_zeros(batch, heads, d_k, v.shape[-1])
    out = []
    for t in range(seq):
        S = S * torch.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - (S * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + k[:, t, ..., None] * delta[..., None, :]
        out.append((S * q[:, t, ..., None]).sum(-2) * d_k**-0.5)
    return torch.stack(out, dim=1)


PROFILE = ROOT / "results" / "calibration" / "example-amd-epyc-2c-np1.yaml"


def _scan_times(fn, inputs, scan, profile, tokens: int) -> dict:
    """The scan's forward + backward measured, and as the cost model prices it."""
    from autosearch.core.hardware import HardwareProfile
    from cost_models.terms.ssm import torch_scan_s

    leaves = [t.detach().requires_grad_(True) for t in inputs]

    def step():
        fn(*leaves).sum().backward()

    prof = HardwareProfile.load(profile)
    return dict(
        scan_fwd_bwd_s=_timed(step),
        scan_predicted_s=torch_scan_s(prof, scan.forward + scan.backward, tokens),
    )


def mamba_row(seq: int, profile: Path = PROFILE) -> dict:
    import torch
    import transformers
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    from autosearch.core._ssm import MambaSpec
    from autosearch.models.ssm import Mamba2Mixer, ssd_scan

    spec = MambaSpec(n_heads=16, head_dim=32, d_state=64, n_groups=4, chunk_size=64)
    hidden = 256
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, spec.n_heads, spec.head_dim, generator=g, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(1, seq, spec.n_heads, generator=g)).double()
    A = -torch.rand(spec.n_heads, generator=g).double()
    B, C = (
        torch.randn(1, seq, spec.n_groups, spec.d_state, generator=g, dtype=torch.float64)
        for _ in range(2)
    )
    want = _ssd_recurrence(x, dt, A, B, C)
    err64 = (ssd_scan(x, dt, A, B, C, chunk_size=spec.chunk_size) - want).abs().max().item()
    f32 = [t.float() for t in (x, dt, A, B, C)]
    err32 = (ssd_scan(*f32, chunk_size=spec.chunk_size).double() - want).abs().max().item()
    config = transformers.NemotronHConfig(
        hidden_size=hidden, mamba_num_heads=spec.n_heads, mamba_head_dim=spec.head_dim,
        ssm_state_size=spec.d_state, n_groups=spec.n_groups, chunk_size=spec.chunk_size,
        layer_norm_epsilon=1e-5, layers_block_type=["mamba"],
    )  # fmt: skip
    theirs = NemotronHMamba2Mixer(config, layer_idx=0)
    ours = Mamba2Mixer(spec, hidden)
    theirs.load_state_dict(ours.to_transformers(ours.state_dict()))
    h = torch.randn(1, seq, hidden, generator=g)
    mixer_err = (ours(h) - theirs(h)).abs().max().item()
    return dict(
        mixer="Mamba-2 (SSD)",
        shape=f"seq {seq}, {spec.n_heads} heads x {spec.head_dim}, N {spec.d_state}, "
        f"{spec.n_groups} groups, chunk {spec.chunk_size}, h {hidden}",
        scan_vs_recurrence_fp64=err64,
        scan_vs_recurrence_fp32=err32,
        mixer_vs_transformers_fp32=mixer_err,
        ours_fwd_bwd_s=_timed(lambda: ours(h).sum().backward()),
        transformers_fwd_bwd_s=_timed(lambda: theirs(h).sum().backward()),
        recurrence_fwd_s=_timed(lambda: _ssd_recurrence(*f32), repeats=1),
        **_scan_times(
            lambda *t: ssd_scan(*t, chunk_size=spec.chunk_size),
            f32,
            spec.torch_scan(seq_len=seq),
            profile,
            seq,
        ),
    )


def gdn_row(seq: int, profile: Path = PROFILE) -> dict:
    import torch
    import transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from autosearch.core._ssm import GatedDeltaNetSpec
    from autosearch.models.ssm import GatedDeltaNet, chunk_gated_delta_rule

    spec = GatedDeltaNetSpec(n_k_heads=4, n_v_heads=8, head_k_dim=32, head_v_dim=32)
    hidden = 256
    g = torch.Generator().manual_seed(1)

    def unit(t):
        return t / t.norm(dim=-1, keepdim=True)

    heads = spec.n_v_heads
    q = unit(torch.randn(1, seq, heads, spec.head_k_dim, generator=g, dtype=torch.float64))
    k = unit(torch.randn(1, seq, heads, spec.head_k_dim, generator=g, dtype=torch.float64))
    v = torch.randn(1, seq, heads, spec.head_v_dim, generator=g, dtype=torch.float64)
    decay = -torch.rand(1, seq, heads, generator=g, dtype=torch.float64)
    beta = torch.rand(1, seq, heads, generator=g, dtype=torch.float64)
    want = _delta_recurrence(q, k, v, decay, beta)
    c = spec.chunk_size
    err64 = (chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=c) - want).abs().max()
    f32 = [t.float() for t in (q, k, v, decay, beta)]
    err32 = (chunk_gated_delta_rule(*f32, chunk_size=c).double() - want).abs().max()
    config = transformers.Qwen3NextConfig(
        hidden_size=hidden, linear_num_key_heads=spec.n_k_heads,
        linear_num_value_heads=spec.n_v_heads, linear_key_head_dim=spec.head_k_dim,
        linear_value_head_dim=spec.head_v_dim, rms_norm_eps=1e-5, num_hidden_layers=1,
        layer_types=["linear_attention"],
    )  # fmt: skip
    theirs = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    ours = GatedDeltaNet(spec, hidden)
    theirs.load_state_dict(ours.to_transformers(ours.state_dict()))
    h = torch.randn(1, seq, hidden, generator=g)
    mixer_err = (ours(h) - theirs(h)).abs().max().item()
    return dict(
        mixer="Gated DeltaNet",
        shape=f"seq {seq}, {spec.n_k_heads} key / {spec.n_v_heads} value heads x "
        f"{spec.head_k_dim}, chunk {c}, h {hidden}",
        scan_vs_recurrence_fp64=err64.item(),
        scan_vs_recurrence_fp32=err32.item(),
        mixer_vs_transformers_fp32=mixer_err,
        ours_fwd_bwd_s=_timed(lambda: ours(h).sum().backward()),
        transformers_fwd_bwd_s=_timed(lambda: theirs(h).sum().backward()),
        recurrence_fwd_s=_timed(lambda: _delta_recurrence(*f32), repeats=1),
        **_scan_times(
            lambda *t: chunk_gated_delta_rule(*t, chunk_size=c),
            f32,
            spec.torch_scan(seq_len=seq),
            profile,
            seq,
        ),
    )


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--out", default=str(ROOT / "results" / "ssm_scans.csv"))
    parser.add_argument("--profile", default=str(PROFILE), help="a CPU hardware profile YAML")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the profile's: 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [mamba_row(args.seq, Path(args.profile)), gdn_row(args.seq, Path(args.profile))]
    for row in rows:
        print(f"{row['mixer']} ({row['shape']})")
        print(
            f"  chunked scan vs recurrence: {row['scan_vs_recurrence_fp64']:.1e} (fp64), "
            f"{row['scan_vs_recurrence_fp32']:.1e} (fp32); mixer vs transformers (fp32): "
            f"{row['mixer_vs_transformers_fp32']:.1e}"
        )
        print(
            f"  forward + backward: ours {row['ours_fwd_bwd_s'] * 1e3:.1f} ms, transformers "
            f"{row['transformers_fwd_bwd_s'] * 1e3:.1f} ms; recurrence forward alone "
            f"{row['recurrence_fwd_s'] * 1e3:.1f} ms"
        )
        print(
            f"  scan alone, forward + backward: measured {row['scan_fwd_bwd_s'] * 1e3:.1f} ms, "
            f"cost model (torch_chunked, {Path(args.profile).name}) "
            f"{row['scan_predicted_s'] * 1e3:.1f} ms "
            f"({row['scan_predicted_s'] / row['scan_fwd_bwd_s']:.2f}x)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
