"""Validation by real runs: failures are recorded, not fatal, and the others still run.

Runs the reference transformer (2 layers, CPU) for 1-2 steps per candidate; the failing
candidates use factories from tests/validation_factories.py that crash, abort or hang.
"""

from pathlib import Path

import pandas as pd
import pytest

from autosearch import ModelSpec, Strategy
from autosearch.validation import validate
from autosearch.validation._launch import classify

FACTORIES = Path(__file__).resolve().parent / "validation_factories.py"
SPEC = ModelSpec.load("tiny-gpt").scaled(n_layers=2, seq_len=64)
S1 = Strategy(micro_batch_size=2, global_batch_size=4, amp="fp32")


def test_failures_are_recorded_and_the_others_complete(tmp_path):
    out = tmp_path / "val"
    # one OOM (a 1 MiB device), one crash, one ok: the order shows a failure does not stop the rest
    rows = []
    for name, kwargs in [
        ("oom", dict(memory_limit_bytes=1 << 20)),
        ("crash", dict(factory=f"{FACTORIES}:crash")),
        ("ok", dict(factory=f"{FACTORIES}:reference")),
    ]:
        result = validate(
            SPEC, [S1], steps=1, warmup=1, timeout_s=240, out=out / name, verbose=False, **kwargs
        )
        rows.append(result.table.iloc[0])
    oom, crash, ok = rows
    assert oom.status == "oom" and "out of memory" in oom.reason
    assert (
        crash.status == "crashed" and "ValueError: a bug in the user's model code" in crash.reason
    )
    assert ok.status == "ok" and ok.measured_step_time_s > 0 and ok.measured_peak_memory_bytes > 0
    csv = pd.read_csv(out / "ok" / "validation.csv")
    assert list(csv.status) == ["ok"]


def test_timeout_and_native_crash_in_one_batch(tmp_path):
    """A hang is killed at the timeout, a native abort has no result file; both are rows."""
    result = validate(
        SPEC,
        [S1, Strategy(dp=2, micro_batch_size=2, global_batch_size=4, amp="fp32")],
        steps=1,
        warmup=0,
        timeout_s=10,
        out=tmp_path,
        verbose=False,
        factory=f"{FACTORIES}:hang",
    )
    assert list(result.table.status) == ["timeout", "timeout"] and result.best is None
    assert "no result after 10 s" in result.table.reason[0]
    aborted = validate(
        SPEC,
        [S1],
        steps=1,
        warmup=0,
        timeout_s=120,
        out=tmp_path / "abort",
        verbose=False,
        factory=f"{FACTORIES}:abort",
    )
    assert aborted.table.status[0] == "crashed" and "SIGABRT" in aborted.table.reason[0]


def test_invalid_candidates_are_rows_too(tmp_path):
    bad = Strategy(tp=3, global_batch_size=4)  # 4 heads do not split over tp=3
    result = validate(SPEC, [bad], steps=1, warmup=0, out=tmp_path, verbose=False)
    assert (
        result.table.status[0] == "invalid"
        and "tp=3 does not divide n_heads=4" in result.table.reason[0]
    )


@pytest.mark.parametrize(
    "code,ranks,timed_out,status",
    [
        (0, [{"rank": 0, "status": "ok"}], False, "ok"),
        (1, [{"rank": 0, "status": "oom", "error_type": "OutOfMemoryError"}], False, "oom"),
        (
            1,
            [
                {"rank": 0, "status": "ok"},
                {"rank": 1, "status": "crashed", "error_type": "RuntimeError"},
            ],
            False,
            "crashed",
        ),
        (-9, [], False, "oom"),
        (None, [], True, "timeout"),
    ],
)
def test_classification_uses_exit_status_and_exception_types(code, ranks, timed_out, status):
    outcome = classify(code, ranks, nproc=max(1, len(ranks)), timed_out=timed_out, timeout_s=5)
    assert outcome.status == status
    if code == -9:
        assert "SIGKILL" in outcome.reason and "out-of-memory killer" in outcome.reason
    assert outcome.status == status


def test_validate_cli_runs_the_top_candidates_of_a_study(tmp_path, capsys):
    """tune -> validate --study: the top candidate runs, its measured figures land in
    validation.csv and in the study (as the study attribute validation/<trial number>)."""
    import optuna
    import yaml

    from autosearch.cli import main
    from autosearch.tuning import open_storage

    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump({**SPEC.to_dict(), "name": "tiny2"}))
    out = tmp_path / "study"
    assert (
        main(
            [
                "tune",
                "--model",
                str(model),
                "--cluster",
                "h100-sxm:1x2",
                "--global-batch-size",
                "4",
                "--out",
                str(out),
                "--quiet",
                "--pin",
                "amp=fp32",
            ]
        )
        == 0
    )
    code = main(["validate", "--study", str(out), "--top-k", "1", "--steps", "1", "--warmup", "0"])
    printed = capsys.readouterr().out
    assert code == 0 and "best measured" in printed
    table = pd.read_csv(out / "validation" / "validation.csv")
    assert list(table.status) == ["ok"] and table.predicted_step_time_s[0] > 0
    storage = open_storage(str(out / "study.journal"))
    study = optuna.load_study(
        study_name=optuna.get_all_study_summaries(storage)[0].study_name, storage=storage
    )
    recorded = [v for k, v in study.user_attrs.items() if k.startswith("validation/")]
    assert (
        len(recorded) == 1
        and recorded[0]["status"] == "ok"
        and recorded[0]["measured_step_time_s"] > 0
    )
    assert (out / "validation" / "best_measured_strategy.yaml").exists()


def test_validate_cli_user_errors(tmp_path, capsys):
    from autosearch.cli import main

    assert main(["validate", "--study", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["validate", "--strategies", str(tmp_path / "s.yaml")]) == 2
    assert "--strategies needs --model" in capsys.readouterr().err


def test_native_deaths_are_named_by_their_signal(tmp_path):
    """A rank killed by SIGKILL (the kernel's OOM killer) is an OOM; a segfault names SIGSEGV;
    neither rank wrote a result, the guard around each rank recorded how it ended."""
    dp2 = Strategy(dp=2, micro_batch_size=2, global_batch_size=4, amp="fp32")
    result = validate(
        SPEC,
        [S1, dp2],
        steps=1,
        warmup=0,
        timeout_s=120,
        out=tmp_path,
        verbose=False,
        factory=f"{FACTORIES}:native_death",
    )
    killed, segv = result.table.iloc[0], result.table.iloc[1]
    assert killed.status == "oom" and "SIGKILL" in killed.reason
    assert "out-of-memory killer" in killed.reason
    assert segv.status == "crashed" and "rank 1: SIGSEGV" in segv.reason
    assert "exit status" not in segv.reason


@pytest.mark.parametrize(
    "factory,message",
    [
        ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
        (f"{FACTORIES}:missing", "has no attribute 'missing'"),
        (f"{FACTORIES}:not_callable", "'not_callable' is a int, not a function"),
        (f"{FACTORIES}:two_args", "must take one argument"),
        (str(FACTORIES.parent / "nowhere.py") + ":f", "no file"),
        ("build", "is not 'package.module:function'"),
    ],
)
def test_a_bad_factory_is_refused_before_any_run(tmp_path, factory, message):
    from autosearch.core.errors import SpecError

    with pytest.raises(SpecError, match=message):
        validate(SPEC, [S1], steps=1, out=tmp_path / "val", verbose=False, factory=factory)
    assert not (tmp_path / "val").exists()  # nothing started, nothing written


def test_cpu_refuses_candidates_beyond_this_machine_unless_forced(tmp_path, capsys):
    from autosearch.cli import main
    from autosearch.core.errors import SpecError

    many = Strategy(dp=1024, micro_batch_size=1, global_batch_size=1024)  # > 4 per core
    with pytest.raises(SpecError, match="--force") as refused:
        validate(SPEC, [many], out=tmp_path / "a", verbose=False)
    assert "would start 1024 processes on" in str(refused.value)
    big = ModelSpec.load("llama3-70b")  # ~1 TB of fp32 weights and Adam states in one process
    with pytest.raises(SpecError, match=r"needs about [\d,.]+ GiB .* cost model's estimate"):
        validate(big, [Strategy(global_batch_size=1)], out=tmp_path / "b", verbose=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    (tmp_path / "s.yaml").write_text(
        "dp: 1024\ntp: 1\npp: 1\nmicro_batch_size: 1\nglobal_batch_size: 1024\n"
    )
    args = ["validate", "--strategies", str(tmp_path / "s.yaml"), "--model", "tiny-gpt"]
    assert main(args + ["--out", str(tmp_path / "c")]) == 2
    assert "--force" in capsys.readouterr().err


def test_the_cpu_bound_is_four_processes_per_core_and_the_memory_available():
    from autosearch.validation._validate import Candidate, too_big_for_this_cpu

    def refused(world, *, cores=2, available=1e12, limit=None):
        s = Strategy(dp=world, micro_batch_size=1, global_batch_size=world, amp="fp32")
        return too_big_for_this_cpu(
            SPEC, [Candidate(s)], cores=cores, memory_limit_bytes=limit, available_bytes=available
        )

    assert refused(8) == [] and "would start 9 processes on 2 cores" in refused(9)[0]
    assert refused(2, available=1e3) and "needs about" in refused(2, available=1e3)[0]
    assert refused(2, available=1e4, limit=100) == []  # a capped device needs at most the cap


def test_validate_help_says_the_factory_is_user_code_run_on_every_rank(capsys):
    from autosearch.cli import main

    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "runs your code" in text and "on every rank" in text and "--force" in text


def test_a_validation_started_inside_a_torchrun_job_does_not_join_it(tmp_path, monkeypatch):
    """RANK, WORLD_SIZE and MASTER_PORT of the job around it are not passed on: the candidate
    runs as the single process it is."""
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "9",
        "TORCHELASTIC_RUN_ID": "job",
    }.items():
        monkeypatch.setenv(key, value)
    result = validate(SPEC, [S1], steps=1, warmup=0, timeout_s=120, out=tmp_path, verbose=False)
    row = result.table.iloc[0]
    assert row.status == "ok", row.reason
    assert list(tmp_path.glob("run000_*/rank*.json"))[0].name == "rank0.json"


def test_validation_picks_distinct_kinds_not_near_duplicates():
    """Of the study's best strategies, validation runs one per kind (axes, ZeRO-3 or not,
    recompute, precision) before it runs a second of any kind."""
    from autosearch.tuning import Candidate
    from autosearch.validation import distinct_kinds

    ranked = [
        Candidate(Strategy(dp=8, micro_batch_size=1, global_batch_size=64, zero_stage=3)),
        Candidate(Strategy(dp=8, micro_batch_size=2, global_batch_size=64, zero_stage=3)),
        Candidate(Strategy(dp=8, micro_batch_size=4, global_batch_size=64, zero_stage=3)),
        Candidate(Strategy(dp=4, tp=2, micro_batch_size=1, global_batch_size=64)),
        Candidate(Strategy(dp=8, micro_batch_size=1, global_batch_size=64, recompute="full")),
    ]
    picked = distinct_kinds(ranked, 3)
    assert picked == [ranked[0], ranked[3], ranked[4]]
    assert distinct_kinds(ranked, 5) == [ranked[0], ranked[3], ranked[4], ranked[1], ranked[2]]


def test_validate_flags_and_config_file_come_from_one_schema(tmp_path, capsys):
    """`autosearch validate`'s flags and its --config keys are ValidateConfig's fields; the
    model, cluster and runtime are TuneConfig's own (one reader, one help text); a flag given
    next to --config overrides the file; --study and --strategies are one or the other."""
    import dataclasses

    import yaml

    from autosearch.cli import build_parser, main
    from autosearch.commands.validate import config_from
    from autosearch.tuning._config import TuneConfig
    from autosearch.validation._config import ValidateConfig

    def parse(*argv):
        return config_from(build_parser().parse_args(["validate", *argv]))

    flags = parse("--strategies", "a.yaml", "b.yaml", "--model", "tiny-gpt", "--steps", "2")
    flags = flags.replace(warmup=0, threads=1, sbatch_arg=("--constraint=x",))
    data = {
        "strategies": ["a.yaml", "b.yaml"],
        "model": "tiny-gpt",
        "steps": 5,
        "warmup": 0,
        "threads": 1,
        "sbatch-arg": ["--constraint=x"],
    }
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(data))
    assert parse("--config", str(tmp_path / "v.yaml"), "--steps", "2") == flags
    assert flags.strategies == ("a.yaml", "b.yaml") and flags.memory_limit_bytes() is None
    tune = {f.name: f.metadata["setting"] for f in dataclasses.fields(TuneConfig)}
    validate_ = {f.name: f.metadata["setting"] for f in dataclasses.fields(ValidateConfig)}
    for name in ("model", "cluster", "runtime", "nnodes", "gpus_per_node"):
        assert validate_[name].read is tune[name].read
        assert validate_[name].help.startswith(tune[name].help.split(" (required")[0])
    assert "(required" not in validate_["model"].help
    assert main(["validate", "--model", "tiny-gpt"]) == 2
    assert "validate needs --study or --strategies" in capsys.readouterr().err
    assert main(["validate", "--study", "s", "--strategies", "a.yaml", "--model", "m"]) == 2
    assert "not both" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("strategies: [a.yaml]\nmodel: tiny-gpt\nsteps: 0\n")
    assert main(["validate", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "steps must be a positive integer" in capsys.readouterr().err
    (tmp_path / "typo.yaml").write_text("strategies: [a.yaml]\nmodel: tiny-gpt\ntop_kk: 2\n")
    assert main(["validate", "--config", str(tmp_path / "typo.yaml")]) == 2
    assert "did you mean 'top_k'" in capsys.readouterr().err
