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
