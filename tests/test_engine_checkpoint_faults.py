"""Checkpoints under faults and hostile files.

* SIGKILL at a random moment of `Engine.save` over an existing checkpoint (a DCP folder, and an
  inference file): the path then loads, holding the previous checkpoint or the new one, never a
  mix or nothing; the next save leaves no temporary (``.partial``, ``.old``, ``.dcp-tmp``) behind.
* A crafted ``.metadata`` (a pickle that would run a command) is refused by `Engine.load`, and
  the command does not run.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import engine_workers as W  # noqa: E402

from autosearch import Engine, SpecError  # noqa: E402

KILLS = 6  # per format; each costs one Python start (~3 s on the shared 2-core machine)
STRATEGY = "micro_batch_size=1,global_batch_size=1,amp=fp32"
SAVER = """
import sys, torch
sys.path.insert(0, {tests!r})
import engine_workers as W
from autosearch import Engine
e = Engine(W.make_model("gpt"), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
           strategy={strategy!r})
e.prepare()
i = 0
while True:
    i += 1
    with torch.no_grad():
        for p in e.model_parts_[0].parameters():
            p.fill_(i)
    e.save({path!r}, training={training!r})
    print(i, flush=True)
"""


def _saved_value(path: Path, training: bool) -> float:
    if training:
        e = Engine(W.make_model("gpt"), strategy=STRATEGY)
        e.load(str(path), load_optimizer=False)
        values = {float(p.detach().flatten()[0]) for p in e.model_parts_[0].parameters()}
    else:
        state = torch.load(path, weights_only=True)
        values = {float(t.flatten()[0]) for k, t in state.items() if not k.endswith("rope")}
    assert len(values) == 1, f"a mix of two checkpoints: {sorted(values)[:4]}"
    return values.pop()


def _leftovers(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if n.endswith((".partial", ".old", ".dcp-tmp"))]


@pytest.mark.slow
@pytest.mark.parametrize("training", [True, False], ids=["dcp_folder", "inference_file"])
def test_kill_during_save_keeps_the_previous_or_the_new_checkpoint(tmp_path, training):
    path = tmp_path / ("ckpt" if training else "model.pt")
    code = SAVER.format(
        tests=str(Path(__file__).parent), strategy=STRATEGY, path=str(path), training=training
    )
    rng = random.Random(12)
    outcomes = []
    for _ in range(KILLS):
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        done = int(proc.stdout.readline())  # one complete save of this child
        time.sleep(rng.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read().split()
        proc.wait()
        done = int(rest[-1]) if rest else done
        torn = bool(_leftovers(tmp_path))  # the kill hit a save in progress
        value = _saved_value(path, training)
        assert value in (done, done + 1), (
            f"after a kill with save {done} complete, the checkpoint holds {value}"
        )
        outcomes.append(
            ("new" if value == done + 1 else "previous") + (" (mid-save)" if torn else "")
        )
    e = Engine(W.make_model("gpt"), strategy=STRATEGY)
    e.save(str(path), training=training)
    assert _leftovers(tmp_path) == []
    assert any("mid-save" in o for o in outcomes), f"no kill landed inside a save: {outcomes}"
    print(f"kills during save ({'folder' if training else 'file'}): {outcomes}")


class _Marker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_crafted_metadata_is_refused_without_running_code(tmp_path):
    e = Engine(W.make_model("gpt"), strategy=STRATEGY)
    e.save(str(tmp_path / "ckpt"))
    assert e.load(str(tmp_path / "ckpt")) == []  # a real checkpoint loads
    marker = tmp_path / "pwned"
    with open(tmp_path / "ckpt" / ".metadata", "wb") as f:
        pickle.dump(_Marker(str(marker)), f)
    with pytest.raises(
        SpecError, match="refusing to load checkpoint.*posix.system|refusing to load checkpoint"
    ):
        Engine(W.make_model("gpt"), strategy=STRATEGY).load(str(tmp_path / "ckpt"))
    assert not marker.exists()


# ---- folders: nothing of the user's is touched (issue 22, items 2, 3, 7) -----------------------
def _engine():
    return Engine(W.make_model("gpt"), strategy=STRATEGY)


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its content (None for folders and links)."""
    out = {}
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            p = Path(root) / name
            out[str(p.relative_to(folder))] = (
                p.read_bytes() if p.is_file() and not p.is_symlink() else None
            )
    return out


def _user_files(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "data").mkdir()
    (folder / "data" / "x.csv").write_text("1,2\n")


@pytest.mark.parametrize(
    "layout",
    ["cwd", "folder-of-files", "old-beside", "partial-beside", "dcp-tmp-beside", "file-at-path"],
)
def test_save_never_touches_what_autosearch_did_not_write(tmp_path, monkeypatch, layout):
    """`Engine.save` into a folder of the user's files, or beside a user's ``run.old/`` (or
    ``.partial``, ``.dcp-tmp``), is refused before anything is written or removed."""
    _user_files(tmp_path / "user")
    target = {
        "cwd": ".",
        "folder-of-files": "user",
        "old-beside": "run",
        "partial-beside": "run",
        "dcp-tmp-beside": "run",
        "file-at-path": "user/notes.txt",
    }[layout]
    if layout.endswith("-beside"):
        suffix = "." + layout[: -len("-beside")].replace("partial", "partial")
        _user_files(tmp_path / f"run{suffix}")
    monkeypatch.chdir(tmp_path / "user" if layout == "cwd" else tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(SpecError, match="autosearch did not write"):
        _engine().save(target)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("name", ["ckpt.partial", "ckpt.old", "ckpt.dcp-tmp", "ckpt"])
def test_a_planted_symlink_is_refused(tmp_path, name):
    """A link planted at a name the save works under would send the checkpoint where it points."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / name).symlink_to(victim)
    before = _tree(tmp_path)
    for training in (True, False):
        with pytest.raises(SpecError, match="symbolic link"):
            _engine().save(str(tmp_path / "ckpt"), training=training)
    assert _tree(tmp_path) == before and not os.listdir(victim)


def test_saves_into_new_empty_or_own_folders_and_leaves_only_its_files(tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("new/ckpt", "empty"):
        e = _engine()
        e.save(str(tmp_path / name))
        e.save(str(tmp_path / name))  # over its own checkpoint
        assert (tmp_path / name / ".autosearch").is_file()
        assert e.load(str(tmp_path / name)) == []
    e.save(str(tmp_path / "model.pt"), training=False)
    e.save(str(tmp_path / "model.pt"), training=False)  # over its own inference file
    assert sorted(os.listdir(tmp_path)) == ["empty", "model.pt", "new"]
    assert sorted(os.listdir(tmp_path / "new")) == ["ckpt"]


def test_a_disk_that_cannot_take_the_checkpoint_ends_in_one_message(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, EFBIG: what a full disk looks like to the writer) in the
    middle of a save: one SpecError, the previous checkpoint loads, no `.partial` is left."""
    code = f"""
import resource, signal, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import engine_workers as W
from autosearch import Engine, SpecError
e = Engine(W.make_model("gpt"), strategy={STRATEGY!r})
e.save({str(tmp_path / "ckpt")!r})
e.save({str(tmp_path / "model.pt")!r}, training=False)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
for path, training in (("ckpt", True), ("model.pt", False)):
    try:
        e.save({str(tmp_path)!r} + "/" + path, training=training)
    except SpecError as exc:
        print("refused:", exc)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("refused:")]
    assert len(lines) == 2 and all("cannot save checkpoint" in ln for ln in lines), res.stdout
    assert "Traceback" not in res.stdout + res.stderr
    assert _leftovers(tmp_path) == [] and not [n for n in os.listdir(tmp_path) if "tmp" in n]
    assert _engine().load(str(tmp_path / "ckpt")) == []
    assert torch.load(tmp_path / "model.pt", weights_only=True)


@pytest.mark.parametrize("what", ["train_state", "inference_file"])
def test_crafted_pickles_are_refused_in_one_message(tmp_path, what):
    """Pickles that would run a command, in the train state or an inference file: one SpecError
    saying the checkpoint holds data autosearch will not unpickle; the command does not run."""
    marker = tmp_path / "pwned"
    e = _engine()
    if what == "train_state":
        path = tmp_path / "ckpt"
        e.save(str(path))
        target = path / "train_state" / "rank0.pt"
    else:
        path = target = tmp_path / "model.pt"
        e.save(str(path), training=False)
    state = torch.load(target, weights_only=True)
    state["evil"] = _Marker(str(marker))
    torch.save(state, target)
    with pytest.raises(SpecError, match="will not unpickle"):
        _engine().load(str(path))
    assert not marker.exists()


def test_a_pickle_in_the_shards_is_refused_in_one_message(tmp_path):
    """DCP stores non-tensor entries (the optimizer's hyper-parameters) as pickles in its shard
    files: a checkpoint whose `lr` is an object that would run a command is refused (one
    SpecError, through DCP's CheckpointException) and the command does not run."""
    import torch.distributed.checkpoint as dcp

    from autosearch.engine import checkpoint as ck

    marker = tmp_path / "pwned"
    e = Engine(W.make_model("gpt"), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    e.prepare()
    parts, opts = e.model_parts_, e.trainer_.checkpoint_optimizers()
    state = {"model": ck.model_state(parts), "optim": {}}
    for osd in ck.optimizer_states(parts, opts):
        state["optim"].update(osd)
    lr = next(k for k in state["optim"] if k.endswith(".lr"))
    state["optim"][lr] = _Marker(str(marker))
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    with pytest.raises(SpecError, match="will not unpickle"):
        Engine(W.make_model("gpt"), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)).load(
            str(tmp_path / "ckpt")
        )
    assert not marker.exists()


def test_a_shard_carrying_a_pickle_is_refused_saying_why(tmp_path):
    """Issue 35: a DCP shard (not only .metadata) holding a pickle that would run a command is
    refused in one message that says torch's restricted unpickler refused it, and why."""
    e = Engine(
        W.make_model("gpt"), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), strategy=STRATEGY
    )
    e.save(str(tmp_path / "ckpt"))
    marker = tmp_path / "pwned"
    for shard in (tmp_path / "ckpt").glob("*.distcp"):
        data = shard.read_bytes()
        crafted = pickle.dumps(_Marker(str(marker)))
        shard.write_bytes(crafted + data[len(crafted) :])
    with pytest.raises(SpecError, match="restricted unpickler refused it: .+") as refused:
        Engine(
            W.make_model("gpt"),
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
            strategy=STRATEGY,
        ).load(str(tmp_path / "ckpt"))
    assert "CheckpointException" not in str(refused.value)
    assert not marker.exists()


def test_a_train_state_cut_short_by_a_full_disk_is_said_as_such():
    """Issue 35: torch.save's zip writer, finding its file shorter than it wrote (a full disk
    during the train state of a second save), ends in the checkpoint's one message."""
    from autosearch.engine.checkpoint import _writing

    def cut_short():
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 4544 vs 4438"
        )

    with pytest.raises(SpecError, match="cannot save checkpoint 'ck': a write was cut short"):
        _writing(cut_short, path="ck")
