"""Kill `autosearch calibrate` while its workers measure (SIGKILL, SIGTERM, SIGINT): no worker is
left (found by an environment marker in /proc) and no temporary folder either; nothing is written
under the asked profile name."""

import os
import signal
import subprocess
import sys
import time

import pytest
from procscan import kill_marked, marked, new_mark, wait_until_gone


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killing_calibrate_leaves_nothing_behind(tmp_path, sig):
    mark = new_mark()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, **mark, "TMPDIR": str(tmp)}
    out = tmp_path / "cpu.yaml"
    cmd = [
        sys.executable,
        "-m",
        "autosearch",
        "calibrate",
        "--quick",
        "--device",
        "cpu",
        "--world-sizes",
        "2",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # calibrate, the supervisor and two ranks, and the run's temporary folder
        deadline = time.monotonic() + 120
        while len(marked(mark)) < 4 or not any(tmp.iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        time.sleep(1.0)  # the ranks are measuring
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        left = wait_until_gone(mark, 20)
    finally:
        kill_marked(mark)
        proc.kill()
    assert code == {signal.SIGKILL: -9, signal.SIGTERM: 143, signal.SIGINT: 130}[sig]
    assert left == []
    assert list(tmp.iterdir()) == []
    assert not out.exists()
