"""This machine: which one it is, and how busy it is, read before anything is measured on it.

A calibrated profile holds one machine's numbers. A CPU's matmul rate follows its model, its cores
and its instruction set (bf16 GEMMs ran 9.5x slower than fp32 on an AVX2-only EPYC, and natively
with avx512_bf16 or AMX: shared/notes/torch-on-this-machine.md), a GPU's its name; so a profile
is this machine's only when the machine it records (`calibration.machine`, written by
`runner.describe_machine`) is the one running: `Machine`, `recorded_machine`, `this_cpu`.

What others run on the cores changes every measurement: a training step with two threads on two
cores, one of them kept busy by another process, ran 8-17x slower than on a quiet machine
(294-514 ms against 24-37 ms, Intel Xeon with AMX, 2 cores). `read_load` samples the CPU time
other processes take (/proc/stat busy time minus this process tree's own, over a short window),
`Load` says whether that is load and how many threads per process still fit in the cores left.

Torch-free and pandas-free: the validation launcher and the calibration both read it before they
start their workers. A GPU's name and count come from the caller (who has torch).
"""

from __future__ import annotations

import os
import platform
import re
import resource
import time
from dataclasses import dataclass
from typing import Any

# Instruction-set flags that bound a CPU's matmul rate (what `lscpu` lists under Flags).
ISA_FLAGS = (
    "avx",
    "fma",
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)
# Of those, the ones that tell two CPUs of one model name apart for the cost model: AVX2 only,
# AVX-512, native bf16 (AVX-512 BF16), AMX. (A VM may hide some from its guest.)
IDENTITY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
# Other processes keeping more than this share of the cores busy is load: a measured step time is
# then as much slower, beyond the ~10% error the cost model has on a quiet machine's runs
# (`quality.WARN_OTHER_LOAD`, the calibration's warning, is this value).
UNDER_LOAD_SHARE = 0.10


# ---- which machine ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Machine:
    """A machine as a profile records it and as it is compared.

    Attributes:
        device: "cpu" or "cuda".
        name: the CPU model name (/proc/cpuinfo) or the GPU's name (torch).
        count: cores this process may use (CPU) or visible GPUs (CUDA); None: not recorded.
        isa: the `IDENTITY_FLAGS` the CPU has, in that order; None: not recorded (calibrations
            before 2026-12 recorded only torch's `cpu_capability`).
    """

    device: str
    name: str
    count: int | None = None
    isa: tuple[str, ...] | None = None

    def describe(self) -> str:
        """``AMD EPYC (cpu, 2 cores, ISA flags not recorded)``."""
        units = "cores" if self.device == "cpu" else "GPUs"
        parts = [self.device] + ([f"{self.count} {units}"] if self.count else [])
        if self.device == "cpu":
            if self.isa is None:
                parts.append("ISA flags not recorded")
            else:
                parts.append(" ".join(self.isa) or f"none of {', '.join(IDENTITY_FLAGS)}")
        return f"{self.name} ({', '.join(parts)})"

    def differences(self, other: "Machine") -> list[str]:
        """How `other` differs from this machine, in the terms a profile depends on; [] when
        they are the same (a field one of them did not record is not compared)."""
        out = []
        if self.device != other.device:
            out.append(f"{self.device} against {other.device}")
        if _words(self.name) != _words(other.name):
            out.append(f"{self.name!r} against {other.name!r}")
        if self.count and other.count and self.count != other.count:
            units = "cores" if self.device == "cpu" else "GPUs"
            out.append(f"{self.count} {units} against {other.count}")
        if self.isa is not None and other.isa is not None and set(self.isa) != set(other.isa):
            out.append(f"ISA {' '.join(self.isa) or '-'} against {' '.join(other.isa) or '-'}")
        return out

    def slug(self) -> str:
        """A folder name for this machine's files: ``amd-epyc-2c``, ``nvidia-h100-x8``."""
        words = re.sub(r"\((r|tm)\)", "", self.name.lower())
        base = re.sub(r"[^a-z0-9]+", "-", words).strip("-") or "unknown"
        if not self.count:
            return base
        return f"{base}-{self.count}c" if self.device == "cpu" else f"{base}-x{self.count}"


def _words(name: str) -> str:
    return " ".join(name.split()).lower()


def recorded_machine(calibration: dict[str, Any], device: str) -> Machine | None:
    """The machine a calibrated profile measured, from its `calibration` record; None when it
    records none (a datasheet profile, a file written by hand)."""
    machine = (calibration or {}).get("machine") or {}
    if device == "cpu":
        name = machine.get("host_cpu") or machine.get("device_name")
        count = machine.get("cpu_cores")
    else:
        name, count = machine.get("device_name"), machine.get("device_count")
    if not name:
        return None
    flags = machine.get("cpu_flags") if device == "cpu" else None
    isa = tuple(f for f in IDENTITY_FLAGS if f in flags) if flags is not None else None
    return Machine(device=device, name=str(name), count=int(count) if count else None, isa=isa)


def this_cpu() -> Machine:
    """This machine's CPU as `recorded_machine` reads a CPU profile's."""
    flags = cpu_isa()["cpu_flags"]
    isa = tuple(f for f in IDENTITY_FLAGS if f in flags) if flags is not None else None
    return Machine(device="cpu", name=cpu_model_name(), count=cpu_cores(), isa=isa)


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask), else every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_isa() -> dict[str, Any]:
    """The matmul-relevant ISA flags of cpu0 and its clock (/proc/cpuinfo "cpu MHz" and, where the
    kernel exposes it, the maximum boost clock from cpufreq), for the plausibility checks."""
    flags: set[str] = set()
    mhz = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "cpu MHz" and mhz is None:
                    mhz = float(value)
    except (OSError, ValueError):
        pass
    max_mhz = None
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq", encoding="ascii") as f:
            max_mhz = float(f.read()) / 1000.0
    except (OSError, ValueError):
        pass
    return {
        "cpu_flags": [f for f in ISA_FLAGS if f in flags] if flags else None,
        "cpu_mhz": mhz,
        "cpu_max_mhz": max_mhz,
    }


# ---- how busy ------------------------------------------------------------------------------
def cpu_time_sample() -> dict[str, float]:
    """Busy and stolen CPU seconds of the cores this process may run on (/proc/stat, summed over
    the CPUs of its affinity mask), this process's own CPU seconds and its reaped children's
    (getrusage), and a monotonic clock. Two samples give the load others put on those cores
    (`load_between`). Empty where /proc/stat is missing."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = steal = 0.0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if not name[3:].isdigit() or (
                    allowed is not None and int(name[3:]) not in allowed
                ):
                    continue
                v = [float(x) for x in fields]
                # user nice system idle iowait irq softirq steal ...: busy excludes idle, iowait
                busy += v[0] + v[1] + v[2] + v[5] + v[6]
                steal += v[7] if len(v) > 7 else 0.0
    except (OSError, ValueError, IndexError):
        return {}
    own = sum(
        r.ru_utime + r.ru_stime
        for r in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )
    return {
        "wall_s": time.monotonic(),
        "busy_s": busy / tick,
        "steal_s": steal / tick,
        "own_s": own,
        "cores": float(len(allowed)) if allowed is not None else float(os.cpu_count() or 1),
    }


def load_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Average number of cores that other processes kept busy (and that the hypervisor stole)
    between two `cpu_time_sample`s: (busy - this process tree's CPU time) / wall time."""
    if not before or not after:
        return {}
    wall = max(after["wall_s"] - before["wall_s"], 1e-9)
    others = (after["busy_s"] - before["busy_s"]) - (after["own_s"] - before["own_s"])
    return {
        "load_other_cores": max(0.0, others / wall),
        "load_steal_cores": max(0.0, (after["steal_s"] - before["steal_s"]) / wall),
        "load_cores": after["cores"],
    }


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages, rounded; None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@dataclass(frozen=True, kw_only=True)
class Load:
    """How busy this machine's cores are.

    Attributes:
        cores: cores this process may run on.
        other_cores: cores other processes kept busy on average while it was read (/proc/stat
            busy time less this process tree's CPU time); None where /proc/stat is missing.
        load_average: the 1-minute load average (it includes this process and decays over a
            minute: a figure to record, not to decide on); None where there is none.
        window_s: how long `other_cores` was read over.
    """

    cores: int
    other_cores: float | None
    load_average: float | None = None
    window_s: float = 0.0

    @property
    def busy_cores(self) -> float:
        """Cores others keep busy: measured, else the load average (an upper bound)."""
        if self.other_cores is not None:
            return self.other_cores
        return self.load_average or 0.0

    @property
    def loaded(self) -> bool:
        return self.busy_cores > UNDER_LOAD_SHARE * self.cores

    def free_cores(self) -> int:
        """Cores left for a measurement: the cores less those others keep busy (rounded), at
        least one."""
        return max(1, self.cores - int(self.busy_cores + 0.5))

    def threads_per_process(self, processes: int) -> int:
        """Intra-op threads for each of `processes` processes so that processes x threads fit
        in the free cores (at least 1: more processes than cores oversubscribe them)."""
        return max(1, self.free_cores() // max(1, processes))

    def describe(self) -> str:
        """``other processes keep 1.0 of 2 cores busy (load average 1.93)``."""
        average = f"load average {self.load_average:.2f}" if self.load_average is not None else ""
        if self.other_cores is None:
            return f"{average or 'load unknown'} on {self.cores} cores"
        return f"other processes keep {self.other_cores:.1f} of {self.cores} cores busy" + (
            f" ({average})" if average else ""
        )


def read_load(window_s: float = 1.0) -> Load:
    """The load on this machine's cores now: the CPU time others take over `window_s` seconds
    (this process sleeps meanwhile) and the load average."""
    before = cpu_time_sample()
    if before:
        time.sleep(window_s)
    measured = load_between(before, cpu_time_sample())
    average = load_average()
    return Load(
        cores=cpu_cores(),
        other_cores=round(measured["load_other_cores"], 2) if measured else None,
        load_average=average[0] if average else None,
        window_s=window_s if measured else 0.0,
    )
