"""End-to-end Engine runs on CPU with gloo, world sizes 2 and 4 (torch.multiprocessing workers).

Every parallel run starts from the same seed and reads the same samples in the same order as a
single-process run with the same micro-batch size and global batch; the losses of 3 AdamW steps
(lr 1e-2, so the weights move) must match:

* bitwise for pipeline parallelism without dp: each stage runs the same ops on the same
  micro-batches, activations cross stages as exact copies, and both runs divide the accumulated
  gradients by the micro-batch count after the last backward;
* for fp32 runs whose arithmetic is reordered (dp averages gradients over ranks instead of
  micro-batches, tp splits each matmul into partial sums added by an all-reduce): within 2e-5
  (absolute, on losses near 4.8) for the first two steps, which see the forward pass and one
  update, and within 1e-3 over all three. Observed: under 1e-6 for two steps; up to 2e-4 later
  for Llama, because Adam's first updates are ~lr * sign(g) and flip for gradient entries near
  zero, which amplifies last-bit differences. An error in the parallel math (a missing gradient
  average, a wrong shard) moves the second-step loss by 1e-2 or more;
* within 1e-2 for 16-bit amp, whose rounding (2^-8 relative for bf16) differs with the
  reduction order: observed 4e-4, while the loss falls by about 0.17 over the 3 steps.
"""

from __future__ import annotations

import os
import tempfile

import pytest

pytest.importorskip("torch")
import engine_workers as W  # noqa: E402  (tests/ is on sys.path under pytest's rootdir conftest)

pytestmark = pytest.mark.slow

B = "micro_batch_size=2,global_batch_size=8"
EXACT, FP32, AMP16 = 0.0, (2e-5, 1e-3), (1e-2, 1e-2)  # (first two steps, all steps)

# name: (strategy, model, tolerance, loss_parallel)
WORLD2 = {
    "dp2": (f"dp=2,{B},amp=fp32", "gpt", FP32),
    "tp2": (f"tp=2,{B},amp=fp32", "gpt", FP32),
    "tp2_sp": (f"tp=2,sequence_parallel=true,{B},amp=fp32", "gpt", FP32),
    "tp2_sp_llama_loss_parallel": (
        f"tp=2,sequence_parallel=true,{B},amp=fp32",
        "llama",
        FP32,
        True,
    ),
    "pp2_gpipe": (f"pp=2,pipeline_schedule=gpipe,{B},amp=fp32", "gpt", EXACT),
    "pp2_1f1b": (f"pp=2,pipeline_schedule=1f1b,{B},amp=fp32", "gpt", EXACT),
    "pp2_uneven_split": (f"pp=2,pipeline_split=1/3,{B},amp=fp32", "gpt", EXACT),
    "pp2_interleaved": (
        f"pp=2,pipeline_schedule=interleaved_1f1b,virtual_stages=2,{B},amp=fp32",
        "gpt",
        EXACT,
    ),
    # Megatron-Core's "E|tt|tt|L" layout: the first chunk holds the embedding alone, the last
    # the output alone (each rank still runs two chunks of the interleaved schedule)
    "pp2_interleaved_empty_ends": (
        f"pp=2,pipeline_schedule=interleaved_1f1b,virtual_stages=2,pipeline_split=0/2/2/0,{B},"
        "amp=fp32",
        "gpt",
        EXACT,
    ),
    "zero1": (f"dp=2,zero_stage=1,{B},amp=fp32", "gpt", FP32),
    "zero2": (f"dp=2,zero_stage=2,{B},amp=fp32", "gpt", FP32),
    "zero3": (f"dp=2,zero_stage=3,{B},amp=fp32", "gpt", FP32),
    "recompute_full": (f"dp=2,recompute=full,{B},amp=fp32", "gpt", FP32),
    "recompute_selective_llama_gqa": (f"tp=2,recompute=selective,{B},amp=fp32", "llama", FP32),
    "amp_bf16": (f"dp=2,{B},amp=bf16", "gpt", AMP16),
    "amp_bf16_zero3": (f"dp=2,zero_stage=3,{B},amp=bf16", "gpt", AMP16),
    "amp_bf16_pp2": (f"pp=2,{B},amp=bf16", "gpt", EXACT),
    "amp_fp16_dp2": (f"dp=2,{B},amp=fp16", "gpt", AMP16),
}
WORLD4 = {
    "dp2_tp2": (f"dp=2,tp=2,{B},amp=fp32", "gpt", FP32),
    "dp2_tp2_zero1": (f"dp=2,tp=2,zero_stage=1,{B},amp=fp32", "gpt", FP32),
    "dp2_tp2_zero3_sp": (
        f"dp=2,tp=2,zero_stage=3,sequence_parallel=true,{B},amp=fp32",
        "gpt",
        FP32,
    ),
    "pp2_dp2": (f"pp=2,dp=2,{B},amp=fp32", "gpt", FP32),
    "pp2_dp2_zero3": (f"pp=2,dp=2,zero_stage=3,{B},amp=fp32", "gpt", FP32),
    "pp2_tp2": (f"pp=2,tp=2,{B},amp=fp32", "gpt", FP32),
}


def _cases(table):
    return [
        dict(name=name, strategy=v[0], model=v[1], loss_parallel=len(v) > 3 and v[3])
        for name, v in table.items()
    ]


def _reference_key(strategy: str, model: str) -> tuple[str, str]:
    amp = strategy.rsplit("amp=", 1)[1]
    return model, amp


@pytest.fixture(scope="module")
def references():
    keys = {_reference_key(v[0], v[1]) for v in [*WORLD2.values(), *WORLD4.values()]}
    return {
        (model, amp): W.reference_losses(f"{B},amp={amp}", model) for model, amp in sorted(keys)
    }


@pytest.fixture(scope="module")
def world2():
    return W.launch(2, "equivalence", _cases(WORLD2))


@pytest.fixture(scope="module")
def world4():
    return W.launch(4, "equivalence", _cases(WORLD4), timeout_s=420)


def _check(results, table, name, references):
    strategy, model, tol = table[name][:3]
    ref = references[_reference_key(strategy, model)]
    got = results[0][name]
    assert all(r[name] == got for r in results), f"{name}: ranks report different losses"
    assert len(got) == len(ref) == W.STEPS
    assert got[-1] < got[0] - 0.05, f"{name}: the loss did not fall ({got})"
    if tol == EXACT:
        assert got == ref, (
            f"{name}: expected bitwise equality with the single-process run, got {got} vs {ref}"
        )
    else:
        early = max(abs(a - b) for a, b in zip(got[:2], ref[:2]))
        gap = max(abs(a - b) for a, b in zip(got, ref))
        assert early <= tol[0] and gap <= tol[1], (
            f"{name}: losses {got} differ from single-process {ref} by {early:.2e} in the first"
            f" two steps (limit {tol[0]}) and {gap:.2e} overall (limit {tol[1]})"
        )


@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_matches_single_process(world2, references, name):
    _check(world2, WORLD2, name, references)


@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_matches_single_process(world4, references, name):
    _check(world4, WORLD4, name, references)


@pytest.fixture(scope="module")
def api_run():
    with tempfile.TemporaryDirectory() as workdir:
        results = W.launch(2, "api", workdir)
        single = _single_process_loads(workdir)
    return results, single


def _single_process_loads(workdir: str) -> dict:
    """Load the pp=2 checkpoints in this (single) process: DCP directory and inference file."""
    import torch

    from autosearch import Engine

    valid = W.dataset("gpt", 16, seed=7)
    e = Engine(
        lambda: W.make_model("gpt"), strategy="micro_batch_size=2,global_batch_size=4,amp=fp32"
    )
    e.load(os.path.join(workdir, "pp2"), load_optimizer=False)
    dcp_loss = e.evaluate(valid, verbose=0)["loss"]
    model = W.make_model("gpt")
    model.load_state_dict(torch.load(os.path.join(workdir, "pp2_model.pt"), weights_only=True))
    e = Engine(model, strategy="micro_batch_size=4,global_batch_size=4,amp=fp32")
    return {"dcp_loss": dcp_loss, "inference_file_loss": e.evaluate(valid, verbose=0)["loss"]}


def test_fit_evaluate_predict_under_tp_sp(api_run):
    results, _ = api_run
    r0, r1 = results
    assert (
        r0["fit_history"]
        == r1["fit_history"]
        == {
            "loss": 6,
            "step_time_s": 6,
            "tokens_per_s": 6,
            "lr": 6,
            "epoch_loss": 2,
            "accuracy": 2,
            "val_loss": 2,
            "val_accuracy": 2,
        }
    )
    assert r0["fit_loss"] == r1["fit_loss"] and r0["fit_loss"][-1] < r0["fit_loss"][0]
    assert r0["tp_eval"] == r1["tp_eval"] and set(r0["tp_eval"]) == {"loss", "accuracy"}
    assert r0["tp_predict_shape"] == [4, 32, 128]  # tp ranks share the batch: whole batch each
    assert r0["tp_predict_sum"] == pytest.approx(r1["tp_predict_sum"], rel=1e-6)
    assert r0["tp_mesh"] == [1, 1, 2]


def test_dataloader_prepare_run_under_pp(api_run):
    results, _ = api_run
    r0, r1 = results
    assert r0["pp_run"] == r1["pp_run"] and len(r0["pp_run"]) == 3
    assert set(r0["pp_run"][0]) == {"loss", "accuracy"}
    assert r0["pp_eval"] == r1["pp_eval"]
    assert sorted([r0["pp_stages"], r1["pp_stages"]]) == [[0], [1]]
    holds_last = {tuple(r["pp_stages"]): r["pp_predict_batches"] for r in results}
    assert holds_last == {
        (0,): 0,
        (1,): 4,
    }  # 16 samples / batch 4; only the last stage has outputs
    shapes = {tuple(r["pp_stages"]): r["pp_predict_inputs_only"] for r in results}
    assert shapes == {(0,): [], (1,): [[4, 32, 128], [4, 32, 128]]}


def test_checkpoint_across_strategies(api_run):
    results, single = api_run
    r0 = results[0]
    # dp=2 ZeRO-3 -> tp=2: same model, and the same optimizer state (the next step agrees too)
    assert r0["tp_loaded_eval"] == pytest.approx(r0["dp_saved_eval"], abs=1e-5)
    assert r0["tp_after_step3_eval"] == pytest.approx(r0["dp_after_step3_eval"], abs=1e-5)
    # ZeRO-1 (optimizer state saved by shares) -> DDP: the step after loading agrees
    assert r0["z0_after_step3_eval"] == pytest.approx(r0["z1_after_step3_eval"], abs=1e-5)
    assert r0["z1_after_step3_eval"] == pytest.approx(r0["dp_after_step3_eval"], abs=1e-5)
    # pp=2 -> single process, from the DCP directory and from the inference state dict
    assert single["dcp_loss"] == pytest.approx(r0["pp_eval"]["loss"], abs=1e-5)
    assert single["inference_file_loss"] == pytest.approx(r0["pp_eval"]["loss"], abs=1e-5)


INVALID = [
    dict(
        name="world_size",
        strategy=f"dp=4,{B}",
        expect="needs dp*tp*pp = 4*1*1 = 4 processes but this run has 2",
    ),
    dict(
        name="tp_heads",
        strategy=f"tp=2,{B}",
        model=dict(hidden_size=48, n_heads=3, n_kv_heads=3),
        expect="tp=2 does not divide n_heads=3",
    ),
    dict(
        name="pipeline_split",
        strategy=f"pp=2,{B}",
        model=dict(n_layers=1),
        expect="n_layers=1 is fewer than pp*virtual_stages = 2*1 = 2 pipeline chunks",
    ),
    dict(
        name="pipeline_split_idle_rank",
        strategy=f"pp=2,pipeline_schedule=interleaved_1f1b,virtual_stages=2,pipeline_split=2/0/2/0,{B}",
        expect="gives pipeline rank 1 no layer",
    ),
    dict(
        name="pipeline_split_empty_middle",
        strategy=f"pp=2,pipeline_schedule=interleaved_1f1b,virtual_stages=2,pipeline_split=2/0/1/1,{B}",
        expect="pipeline chunk 1 of [2, 0, 1, 1] holds no block",
    ),
    dict(
        name="strategy_batch",
        strategy="dp=2,micro_batch_size=3,global_batch_size=9",
        expect="global_batch_size=9 does not split into dp*micro_batch_size",
    ),
    dict(
        name="fit_batch",
        strategy=f"dp=2,{B}",
        batch_size=7,
        expect="batch_size=7 does not split over dp=2",
    ),
]


def test_invalid_strategies_fail_on_every_rank_before_any_step():
    results = W.launch(2, "invalid", INVALID, timeout_s=120)  # a hang would time out here
    for case in INVALID:
        messages = [r[case["name"]] for r in results]
        assert messages[0] == messages[1], f"{case['name']}: ranks disagree: {messages}"
        assert messages[0].startswith("SpecError: ") and case["expect"] in messages[0], messages[0]
        assert "Traceback" not in messages[0]
