"""CostReport: the immutable record of one estimate, with its time and memory breakdowns.

NamedTuples rather than dataclasses: a search builds hundreds of thousands of them, and a
NamedTuple is immutable and several times cheaper to create.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from autosearch.core.bands import Band

GiB = float(1 << 30)


class TimeBreakdown(NamedTuple):
    """Seconds per optimizer step, on the critical path; they add up to the step time."""

    compute_s: float  # forward + backward GEMMs, attention, elementwise ops, embeddings, logits
    recompute_s: float  # forward work repeated by activation recompute
    tp_comm_s: float  # tensor-parallel collectives (exposed)
    pp_comm_s: float  # pipeline point-to-point sends (exposed)
    dp_comm_exposed_s: float  # data-parallel / ZeRO collectives not hidden behind compute
    bubble_s: float  # pipeline fill and drain
    optimizer_s: float  # the optimizer step
    other_s: float  # fixed per-step overhead
    offload_s: float = 0.0  # host-device copies of offload not hidden behind compute

    @property
    def total_s(self) -> float:
        return sum(self)


class MemoryBreakdown(NamedTuple):
    """Bytes per device on the most loaded pipeline stage."""

    params_bytes: float  # parameters in every copy the runtime keeps (fp32, 16-bit, gathered)
    grads_bytes: float
    optimizer_bytes: float  # Adam moments (and fp32 master weights when parameters are 16-bit)
    activations_bytes: float  # saved for backward, all micro-batches in flight, plus logits
    other_bytes: float  # runtime reserve (CUDA context, workspaces, communication buffers)

    @property
    def total_bytes(self) -> float:
        return sum(self)


class CostReport(NamedTuple):
    """What the cost model predicts for one (model, cluster, strategy)."""

    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    model_flops_per_step: float
    tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: float
    memory_capacity_bytes: float
    fits: bool
    time: TimeBreakdown
    memory: MemoryBreakdown
    notes: tuple[str, ...] = ()
    band: Band | None = None  # how sure: actual / predicted step time for 90% of runs of its kind
    # device memory held back for the memory model's error (`with_margin`; the search's rule:
    # autosearch/tuning/_margin.py): `fits` means peak <= capacity - margin
    memory_margin_bytes: float = 0.0
    # offload to host memory: what the node's GPUs keep on its host, and what the host can
    # give them (its memory less a reserve; cost_models/terms/offload.py); 0 without offload
    host_memory_bytes: float = 0.0
    host_memory_capacity_bytes: float = 0.0

    def with_margin(self, margin_bytes: float) -> "CostReport":
        """This report with `margin_bytes` of the device held back: it fits only when its peak
        is at most the capacity less the margin (and the host holds what it offloads)."""
        device = self.peak_memory_bytes <= self.memory_capacity_bytes - margin_bytes
        return self._replace(memory_margin_bytes=margin_bytes, fits=device and self.host_fits)

    @property
    def host_fits(self) -> bool:
        """The node's host holds what its GPUs offload (True without offload)."""
        return self.host_memory_bytes <= self.host_memory_capacity_bytes or not (
            self.host_memory_bytes
        )

    @property
    def fits_host(self) -> bool:
        """`fits` with the host's memory checked too."""
        return self.fits and self.host_fits

    @property
    def memory_usable_bytes(self) -> float:
        """The capacity less the margin: what a strategy may use to fit."""
        return self.memory_capacity_bytes - self.memory_margin_bytes

    @property
    def memory_excess_bytes(self) -> float:
        """How far the strategy is from fitting, margin included (0 when it fits)."""
        return max(0.0, self.peak_memory_bytes - self.memory_usable_bytes)

    @property
    def infeasible_reason(self) -> str | None:
        if self.fits:
            return None
        if not self.host_fits and self.memory_excess_bytes == 0:
            return (
                f"offload needs {self.host_memory_bytes / GiB:.1f} GiB of host memory per node,"
                f" {(self.host_memory_bytes - self.host_memory_capacity_bytes) / GiB:.1f} GiB"
                f" over the {self.host_memory_capacity_bytes / GiB:.1f} GiB it can give; offload"
                " less (activations first), or spread the model over more nodes"
            )
        margin = (
            f" ({self.memory_capacity_bytes / GiB:.1f} GiB less a margin of"
            f" {self.memory_margin_bytes / GiB:.1f} GiB)"
            if self.memory_margin_bytes
            else ""
        )
        return (
            f"needs {self.peak_memory_bytes / GiB:.1f} GiB per device,"
            f" {self.memory_excess_bytes / GiB:.1f} GiB over the"
            f" {self.memory_usable_bytes / GiB:.1f} GiB available{margin}"
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostReport":
        """Rebuild a report from ``to_dict(flat=False)`` (e.g. stored in an Optuna trial)."""
        fields = {
            k: data[k]
            for k in cls._fields
            if k not in ("time", "memory", "notes", "band") and (k in data or k in REQUIRED)
        }
        band = data.get("band")
        return cls(
            band=Band(**band) if isinstance(band, dict) else None,
            **fields,
            time=TimeBreakdown(**data["time"]),
            memory=MemoryBreakdown(**data["memory"]),
            notes=tuple(data.get("notes") or ()),
        )

    def to_dict(self, *, flat: bool = True) -> dict[str, Any]:
        """Every field; with ``flat`` the breakdowns become ``time_<t>`` and ``memory_<t>``."""
        out: dict[str, Any] = {
            k: getattr(self, k)
            for k in self._fields
            if k not in ("time", "memory", "notes", "band")
        }
        out["memory_excess_bytes"] = self.memory_excess_bytes
        band = self.band
        if flat:
            has = band is not None and not band.extrapolation
            low = self.step_time_s * band.low if band is not None and has else None
            high = self.step_time_s * band.high if band is not None and has else None
            out["step_time_band_low_s"] = low
            out["step_time_band_high_s"] = high
            out["band_runs"] = band.runs if band is not None else None
            out["band_kind"] = band.kind if band is not None else None
        else:
            out["band"] = band._asdict() if band is not None else None
        if flat:
            out.update({f"time_{k}": v for k, v in self.time._asdict().items()})
            out.update({f"memory_{k}": v for k, v in self.memory._asdict().items()})
        else:
            out["time"] = self.time._asdict()
            out["memory"] = self.memory._asdict()
        out["infeasible_reason"] = self.infeasible_reason
        out["notes"] = "; ".join(self.notes) if flat else list(self.notes)
        return out


def offload_summary(strategy: Any, report: CostReport) -> str | None:
    """What `strategy` offloads to host memory and what the host holds for it, in one line
    (None when it offloads nothing): ``optimizer states, parameters to host memory: 1,314.2
    GiB of the node's 1,769.4 GiB``."""
    what = [
        name
        for name, on in (
            ("optimizer states", strategy.offload_optimizer),
            ("parameters", strategy.offload_params),
            (
                f"activations ({strategy.offload_activations})",
                strategy.offload_activations != "none",
            ),
        )
        if on
    ]
    if not what:
        return None
    return (
        f"{', '.join(what)} to host memory: {report.host_memory_bytes / GiB:,.1f} GiB per node"
        f" of the {report.host_memory_capacity_bytes / GiB:,.1f} GiB it can give; host copies"
        f" add {report.time.offload_s:.3g} s per step, the optimizer step"
        f" {report.time.optimizer_s:.3g} s"
    )


# The fields a stored report always holds (those added later have defaults).
REQUIRED = tuple(f for f in CostReport._fields if f not in CostReport._field_defaults)
