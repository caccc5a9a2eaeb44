"""A real single-node SLURM for the tests: munged, slurmctld and slurmd from Debian's `slurm-wlm`
and `munge` packages, started in a private folder with their own key, ports and state, and torn
down afterwards (every job cancelled, every daemon stopped). Cgroup-free: `proctrack/linuxproc`
and `task/none`, so it runs in a container as root.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")


def missing() -> str | None:
    """Why this machine cannot host the test cluster, or None."""
    absent = [c for c in DAEMONS + CLIENTS if shutil.which(c) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd starts jobs as their user: the test cluster runs as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return int(kib / 1024 * 0.9)


SLURM_CONF = """\
ClusterName=autosearch-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@contextmanager
def slurm_cluster(*, start_timeout_s: float = 60.0) -> Iterator[dict[str, str]]:
    """Start the cluster; yield the environment its client commands need (SLURM_CONF)."""
    folder = tempfile.mkdtemp(prefix="as-slurm-")  # short: the munge socket path is limited
    os.chmod(folder, 0o755)
    for sub in ("state", "spool"):
        os.mkdir(os.path.join(folder, sub))
    key = os.path.join(folder, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    host = socket.gethostname().split(".")[0]
    conf = os.path.join(folder, "slurm.conf")
    with open(conf, "w", encoding="ascii") as f:
        f.write(
            SLURM_CONF.format(
                host=host,
                user=getpass.getuser(),
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
                dir=folder,
                cpus=os.cpu_count() or 1,
                memory_mb=_memory_mb(),
            )
        )
    env = {**os.environ, "SLURM_CONF": conf}
    log = open(os.path.join(folder, "daemons.log"), "wb")
    daemons: list[subprocess.Popen] = []
    try:
        munge = [
            "munged",
            "--foreground",
            "--force",
            f"--socket={folder}/munge.sock",
            f"--key-file={key}",
            f"--pid-file={folder}/munged.pid",
            f"--seed-file={folder}/munged.seed",
            f"--log-file={folder}/munged.log",
        ]
        for cmd in (munge, ["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", host]):
            daemons.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
            if cmd[0] == "munged":
                _wait(lambda: os.path.exists(f"{folder}/munge.sock"), start_timeout_s, folder)
        _wait(lambda: _node_ready(env), start_timeout_s, folder)
        yield {"SLURM_CONF": conf}
    finally:
        subprocess.run(["scancel", "--full", "--user", getpass.getuser()], env=env, check=False)
        for proc in reversed(daemons):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def _node_ready(env: dict[str, str]) -> bool:
    out = subprocess.run(
        ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False
    )
    return out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated")


def _wait(ready, timeout_s: float, folder: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            logs = ""
            for name in ("daemons.log", "munged.log", "slurmctld.log", "slurmd.log"):
                path = os.path.join(folder, name)
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        logs += f"--- {name}\n{f.read()[-2000:]}\n"
            raise RuntimeError(f"the test SLURM did not start in {timeout_s:.0f} s:\n{logs}")
        time.sleep(0.2)


def queued(env: dict[str, str]) -> list[str]:
    """Jobs squeue lists as pending or running (what a cancelled validation must not leave)."""
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i %T"], env={**os.environ, **env}, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    return out.stdout.split("\n")[:-1]
