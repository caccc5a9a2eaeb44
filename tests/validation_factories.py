"""Model factories for the validation tests: each fails the way a real run can."""

import os
import time

from autosearch.transformer import build


def reference(spec):
    return build(spec)


def crash(spec):
    raise ValueError("a bug in the user's model code")


def hang(spec):
    time.sleep(3600)


def abort(spec):
    os.abort()  # a native crash: no exception, no result file, SIGABRT
