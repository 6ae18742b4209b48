"""One log line at the end of a run: what crossed the RAM->GPU link, what the GPU allocator did and
where host memory went.

The allocator's peaks are also kept per phase of a step (``PhasePeaks``: the start, with
``placement: auto``'s measurement of the non-expert work; forward + backward of the micro-batches;
the optimizer step), so a peak above the plan says where it happened.

Both explain a slow run without a profiler: streamed copies per optimizer step against the two a
checkpointed layer needs (forward, recompute; its backward reuses the recompute's weights), and
the allocator's retries (an allocation that failed under the ``kt_gpu_memory`` limit, so every
cached block was freed and the allocation tried again: a device sync and a cudaFree each).
"""

from __future__ import annotations

import resource
from typing import Any

import torch

from kt_ft.backends.grouped import _WS, GroupedTorchBackend
from kt_ft.base.log import fmt_bytes
from kt_ft.runtime.experts import KTExperts


def stream_stats(model: torch.nn.Module) -> dict[str, Any] | None:
    """The model's stream-scheduler counters (``moe/streamed.py``), or None when nothing streams."""
    sched = next((m.scheduler for m in model.modules() if isinstance(m, KTExperts) and m.streamed), None)
    return sched.stats() if sched is not None else None


def allocator_stats(device: torch.device | None = None) -> dict[str, int] | None:
    """The CUDA caching allocator's counters that say it struggled (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    s = torch.cuda.memory_stats(device)
    return {
        "alloc_retries": int(s.get("num_alloc_retries", 0)),
        "ooms": int(s.get("num_ooms", 0)),
        "device_allocs": int(s.get("num_device_alloc", 0)),
        "device_frees": int(s.get("num_device_free", 0)),
        "peak_reserved": int(s.get("reserved_bytes.all.peak", 0)),
        "peak_allocated": int(s.get("allocated_bytes.all.peak", 0)),
    }


PHASES = ("start", "forward + backward", "optimizer step")


class PhasePeaks:
    """The CUDA allocator's peak allocated / reserved bytes per phase of a training step.

    ``mark(phase)`` closes the phase that just ended: it keeps the allocator's peaks since the last
    mark under ``phase`` (the largest over the run) and resets them (``torch.cuda.reset_peak_memory_stats``).
    The trainer callback marks ``start`` before the first step, ``forward + backward`` before each
    optimizer step and ``optimizer step`` after it."""

    def __init__(self) -> None:
        self.peaks: dict[str, tuple[int, int]] = {}

    def mark(self, phase: str) -> None:
        if not torch.cuda.is_available():
            return
        a, r = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        pa, pr = self.peaks.get(phase, (0, 0))
        self.peaks[phase] = (max(pa, a), max(pr, r))
        torch.cuda.reset_peak_memory_stats()

    def line(self) -> str | None:
        if not self.peaks:
            return None
        order = [p for p in PHASES if p in self.peaks] + [p for p in self.peaks if p not in PHASES]
        return "GPU allocator peak by phase (allocated / reserved): " + ", ".join(
            f"{p} {fmt_bytes(self.peaks[p][0])} / {fmt_bytes(self.peaks[p][1])}" for p in order
        )


def host_stats(model: torch.nn.Module) -> str:
    """Where host memory went: the process's peak resident set (``ru_maxrss``), the CUDA host
    (pinned) allocator's peak reserve, and what the CPU op keeps between calls (its layers'
    backward state, its shared scratch buffers)."""
    parts = [f"host: peak RSS {fmt_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}"]
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        try:
            pinned = int(torch.cuda.host_memory_stats().get("reserved_bytes.peak", 0))
            parts.append(f"pinned peak {fmt_bytes(pinned)}")
        except RuntimeError:  # no CUDA context made yet
            pass
    sets, saved = 0, 0
    seen: set[int] = set()
    for m in model.modules():
        backend = getattr(getattr(m, "runner", None), "backend", None)
        if isinstance(m, KTExperts) and isinstance(backend, GroupedTorchBackend) and id(backend) not in seen:
            # (a backend shared by several layers is counted once)
            seen.add(id(backend))
            n, b = backend.host_bytes()
            sets, saved = sets + n, saved + b
    if seen:
        parts.append(
            f"CPU op backward state {fmt_bytes(saved)} in {sets} sets, scratch {fmt_bytes(_WS.nbytes())}"
        )
    return ", ".join(parts)


def cpu_op_stats(model: torch.nn.Module) -> str | None:
    """The CPU expert op's wall time over the run, all layers (``ExpertRunner.busy_s``: forward and
    backward calls, inside the backend): beside the step time it says what share the op took, and
    ``kt-ft bench --parts e2e`` sets it against ``--parts op``'s time for the same shape."""
    runners = [m.runner for m in model.modules() if isinstance(m, KTExperts) and m.runner.forward_calls]
    if not runners:
        return None
    busy = sum(r.busy_s for r in runners)
    calls = sum(r.forward_calls for r in runners)
    return f"CPU op busy {busy:.3f} s in {calls} forward calls over {len(runners)} layers"


def run_summary(model: torch.nn.Module, steps: int) -> str:
    """``steps`` optimizer steps ran: the line the end of training logs."""
    parts = []
    st = stream_stats(model)
    if st is not None:
        per = max(steps, 1)
        by = ", ".join(f"{k} {v}" for k, v in sorted(st["copies_by"].items()))
        parts.append(
            f"streamed {fmt_bytes(st['bytes_streamed'])} in {st['copies']} copies ({st['copies'] / per:.1f} a step; "
            f"{by}), {st['hits']} uses found their layer in a buffer ({st['prefetch_hits']} by prefetch)"
        )
    al = allocator_stats()
    phases: PhasePeaks | None = getattr(model, "_kt_ft_phase_peaks", None)
    if al is not None:
        if phases is not None and phases.peaks:  # the allocator's own peak restarted at each mark
            al["peak_allocated"] = max(al["peak_allocated"], *(a for a, _ in phases.peaks.values()))
            al["peak_reserved"] = max(al["peak_reserved"], *(r for _, r in phases.peaks.values()))
        parts.append(
            f"GPU allocator: peak {fmt_bytes(al['peak_allocated'])} allocated / {fmt_bytes(al['peak_reserved'])} "
            f"reserved, {al['alloc_retries']} retries after freeing the cache, {al['device_allocs']} cudaMalloc / "
            f"{al['device_frees']} cudaFree"
        )
    if phases is not None and phases.line():
        parts.append(phases.line())
    op = cpu_op_stats(model)
    if op is not None:
        parts.append(op)
    parts.append(host_stats(model))
    return "; ".join(parts)
