"""Model factories for the validation tests: each fails the way a real run can."""

import os
import time

from autosearch.models.transformer import build


def reference(spec):
    return build(spec)


def crash(spec):
    raise ValueError("a bug in the user's model code")


def hang(spec):
    time.sleep(3600)


def abort(spec):
    os.abort()  # a native crash: no exception, no result file, SIGABRT


def native_death(spec):
    """One process: killed by SIGKILL, as the OOM killer does. Two: rank 1 segfaults, rank 0
    waits to be stopped by torchrun. Neither writes a result; the rank's guard must."""
    import ctypes
    import signal

    if os.environ.get("WORLD_SIZE", "1") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("RANK") == "1":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    time.sleep(600)


def two_args(spec, other):
    return build(spec)


not_callable = 42


def fault_point(spec):
    """For the fault tests: one process trains (a candidate that finishes); under torchrun each
    rank says it is ready in $FAULT_READY_DIR and waits to be killed."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        return build(spec)
    ready = os.path.join(os.environ["FAULT_READY_DIR"], f"rank{os.environ['RANK']}")
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def meta_only(spec):
    """The reference model, refused unless it is being built on the meta device (validation
    workers build with meta_init and allocate only each rank's shards)."""
    import torch

    model = build(spec)
    if next(model.parameters()).device != torch.device("meta"):
        raise RuntimeError("the model was built on the host, not on the meta device")
    return model
