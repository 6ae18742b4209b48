"""One log line at the end of a run: what crossed the RAM->GPU link and what the GPU allocator did.

Both explain a slow run without a profiler: streamed copies per optimizer step against the two a
checkpointed layer needs (forward, recompute; its backward reuses the recompute's weights), and
the allocator's retries (an allocation that failed under the ``kt_gpu_memory`` limit, so every
cached block was freed and the allocation tried again: a device sync and a cudaFree each).
"""

from __future__ import annotations

from typing import Any

import torch

from .log import fmt_bytes
from .moe.experts import KTExperts


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
    if al is not None:
        parts.append(
            f"GPU allocator: peak {fmt_bytes(al['peak_allocated'])} allocated / {fmt_bytes(al['peak_reserved'])} "
            f"reserved, {al['alloc_retries']} retries after freeing the cache, {al['device_allocs']} cudaMalloc / "
            f"{al['device_frees']} cudaFree"
        )
    return "; ".join(parts) if parts else "nothing streamed, no GPU"
