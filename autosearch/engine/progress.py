"""What `Engine.fit` shows and records on rank 0: a progress bar or lines, a CSV of metrics, and
optionally TensorBoard.

On a terminal the progress is a tqdm bar (when tqdm is installed: ``pip install
'autosearch[train]'``); otherwise, in logs and CI, one plain line every `log_freq` steps. MFU is
model FLOPs per second over the peak of every device of the cluster in the run's precision
(Chowdhery et al. 2022, appendix B: 6N + 12 l h s FLOPs per token, `ModelSpec.flops_per_token`);
it needs the model's ModelSpec and the engine's cluster, and is left out without them.
"""

from __future__ import annotations

import csv
import os
import sys
from typing import Any, TextIO

from autosearch.core.errors import SpecError

CSV_FIELDS = ("step", "epoch", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu")


def _tqdm():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


class TrainLogger:
    """Progress and metric files of one `fit` call (does nothing on ranks other than 0).

    Args:
        enabled: this process is rank 0.
        verbose: 0 silent, 1 one line per epoch, 2 also progress every `log_freq` steps.
        log_freq: steps between plain progress lines.
        total_steps: optimizer steps of the whole run, if known (for the bar).
        log_dir: folder of ``metrics.csv`` (appended to, so a resumed run continues the file).
        tensorboard: also write TensorBoard scalars to `log_dir`.
        flops_per_token, peak_flops: for MFU (both or neither).
        first_step: the global step the run starts after (0, or the resumed checkpoint's).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        verbose: int,
        log_freq: int,
        total_steps: int | None,
        log_dir: str | None,
        tensorboard: bool,
        flops_per_token: float | None,
        peak_flops: float | None,
        first_step: int = 0,
    ):
        self.enabled, self.verbose, self.log_freq = enabled, verbose, max(1, log_freq)
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.bar: Any = None  # a tqdm bar
        self._tb: Any = None  # a TensorBoard SummaryWriter
        self._csv_file: TextIO | None = None
        self._csv: csv.DictWriter | None = None
        if tensorboard and log_dir is None:
            raise SpecError("tensorboard=True needs log_dir=... (the folder TensorBoard reads)")
        if not enabled:
            return
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, "metrics.csv")
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            self._csv_file = open(path, "a", newline="", encoding="utf-8")
            self._csv = csv.DictWriter(
                self._csv_file, fieldnames=CSV_FIELDS, extrasaction="ignore"
            )
            if new:
                self._csv.writeheader()
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    raise SpecError(
                        "tensorboard=True needs the tensorboard package: pip install "
                        "'autosearch[train]' (or tensorboard), or leave tensorboard off"
                    ) from None
                self._tb = SummaryWriter(log_dir)
        tqdm = _tqdm()
        if verbose >= 2 and tqdm is not None and sys.stdout.isatty():
            self.bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def mfu(self, tokens_per_s: float) -> float | None:
        if not self.flops_per_token or not self.peak_flops:
            return None
        return tokens_per_s * self.flops_per_token / self.peak_flops

    def step(
        self,
        step: int,
        epoch: int,
        logs: dict[str, Any],
        *,
        batch: int,
        epochs: int,
        batches: int | None,
    ) -> None:
        """Record one optimizer step: `step` counts from 1 over the whole run, `batch` from 1
        within `epoch` (of `epochs`, `batches` per epoch if known)."""
        if not self.enabled:
            return
        row = {"step": step, "epoch": epoch, **logs}
        if self._csv is not None and self._csv_file is not None:
            self._csv.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
            self._csv_file.flush()
        if self._tb is not None:
            for key in CSV_FIELDS[2:]:
                if row.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", row[key], step)
        text = f"loss {logs['loss']:.4f} | {logs['tokens_per_s']:,.0f} tok/s"
        if logs.get("mfu") is not None:
            text += f" | MFU {100 * logs['mfu']:.1f}%"
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(text)
        elif self.verbose >= 2 and batch % self.log_freq == 0:
            total = f"/{batches}" if batches else ""
            print(
                f"epoch {epoch + 1}/{epochs} step {batch}{total} {text} "
                f"| {logs['step_time_s'] * 1e3:.0f} ms/step",
                flush=True,
            )

    def scalars(self, step: int, values: dict[str, float], prefix: str) -> None:
        if self.enabled and self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(f"{prefix}/{key}", value, step)

    def message(self, text: str) -> None:
        if not self.enabled or self.verbose < 1:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for thing in (self.bar, self._csv_file, self._tb):
            if thing is not None:
                thing.close()
