"""Capturing CUDA graphs of the expert work (``graphed.py``): the buffers and memory they share,
the capture itself, and what a failed one says.

- ``Workspace``: the static buffers (inputs, output, the saved tensors, the gradients) and the graph
  memory pool that every layer of one signature shares, and which pending forward's saved tensors
  the buffers hold (``claim`` copies a previous owner's out for it first: an eviction);
- ``capture_into``: a capture on a side stream that leaves the caller's stream current and the
  allocator usable however the capture ends (``torch.cuda.graph`` does neither on a failure);
- ``failure``: where a failed capture stopped, for its log line.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import weakref

import torch

from kt_ft.backends.grouped_device import FusedMeta

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # kt_ft/


def failure(e: BaseException) -> str:
    """``at file:line (function): <e's first line>``, the frame being the innermost of kt-ft's own
    code in ``e``'s traceback: where a failed capture stopped, for its log line (captures fail on
    the GPU only, where a traceback is not at hand)."""
    frames = [
        f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename).startswith(_PACKAGE)
    ]
    where = (
        f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} ({frames[-1].name})" if frames else "?"
    )
    return f"at {where}: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"


def copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), unless src already is dst (written in place through ``into``)."""
    if src.data_ptr() != dst.data_ptr() or src.shape != dst.shape or src.stride() != dst.stride():
        dst.copy_(src)


_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def capture_into(g: torch.cuda.CUDAGraph, ws: Workspace, device):
    """Capture into ``g`` (its memory from ``ws.pool``, thread-local error mode) on a side stream of
    ``device``; the caller's stream is current again afterwards however the capture ends.

    Not ``torch.cuda.graph``: that synchronizes the device and collects Python garbage before every
    capture (a run of varied lengths captures three graphs a layer and bucket), and when an op
    inside fails, its exit raises from ``capture_end`` before it restores the stream, so the rest
    of the step would run on the side stream, unordered with other threads' streams (the autograd
    engine's). The allocator's cache is still emptied first: the graph's pool cannot take blocks
    cached for the rest of the step, so without it every capture's memory came on top of them
    (measured: 45.3 GiB reserved for 35.2 allocated, against 37.0 with it).

    A failed capture's ``capture_end`` raises before it ends the routing of allocations to the pool,
    in the device allocator and (PyTorch 2.11; not 2.9) the pinned host allocator, so the next capture
    into that pool (another layer's) failed with "already recording to mempool_id". The device
    allocator's routing is ended here (left on, every later allocation would ask the driver for
    the dead capture's status); the host allocator's has no hook, so the workspace moves on to a
    fresh pool."""
    device = torch.device(device)
    torch.cuda.empty_cache()
    caller = torch.cuda.current_stream(device)
    stream = _capture_streams.get(device)
    if stream is None:
        stream = _capture_streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(caller)
    torch.cuda.set_stream(stream)
    try:
        pool = ws.pool
        g.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        except BaseException:
            # end the capture the op invalidated; its error ("a previous error during capture")
            # would hide the op's own, which says what failed
            with contextlib.suppress(RuntimeError):
                g.capture_end()
            _end_pool_allocation(device, pool)
            ws.pool = torch.cuda.graph_pool_handle()
            raise
        g.capture_end()
    finally:
        torch.cuda.set_stream(caller)


@contextlib.contextmanager
def warm_up_stream(device):
    """Run a capture's warm-up on a fresh side stream of ``device``, ordered after the caller's
    stream's work and before its later work (lazy initialisations stay out of the capture)."""
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        yield
    caller.wait_stream(side)


def _end_pool_allocation(device: torch.device, pool) -> None:
    """End routing ``device``'s allocations to ``pool`` if a failed capture left it on (no-op when
    ``capture_end`` got that far, or on a PyTorch without the hook)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        with contextlib.suppress(RuntimeError):
            end(device.index if device.index is not None else torch.cuda.current_device(), pool)


class Workspace:
    """Static buffers (inputs, output, the saved tensors, the gradients) and the graph memory pool
    shared by every layer of one signature (device, token count, sizes, dtypes)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.bufs: dict[str, torch.Tensor] = {}
        self.owner: weakref.ref | None = None  # the Pending whose saved tensors fill the buffers
        self.keep_saved = True  # False after an eviction: forwards with grad run eagerly
        self.n_saved = 0  # fused_forward's saved tensors kept here (the base weights are static)

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The static buffer ``name`` with ``like``'s shape and dtype (made at the first ask)."""
        b = self.bufs.get(name)
        if b is None:
            b = self.bufs[name] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        elif b.shape != like.shape or b.dtype != like.dtype:
            raise RuntimeError(
                f"workspace buffer {name}: {tuple(b.shape)} {b.dtype}, asked {tuple(like.shape)} {like.dtype}"
            )
        return b

    def saved(self) -> tuple[torch.Tensor | None, ...]:
        """fused_forward's saved tensors as the buffers hold them (None where it saved none)."""
        return tuple(self.bufs.get(f"saved{i}") for i in range(self.n_saved))

    def claim(self, pending: Pending) -> bool:
        """A graph that writes the saved buffers is about to replay for ``pending``: a previous
        owner still waiting for its backward gets a copy of its tensors first (an eviction: from
        then on forwards with grad run eagerly here). Returns whether it evicted one."""
        old = self.owner() if self.owner is not None else None
        evicted = old is not None and old is not pending and old.in_workspace
        if evicted:
            old.saved = tuple(None if t is None else t.clone() for t in self.saved())
            old.counts = self.bufs["counts"].clone()
            old.in_workspace = False
            self.keep_saved = False
        self.owner = weakref.ref(pending)
        return evicted


class Pending:
    """One forward with grad, until its backward: its tensors in the workspace, or copies."""

    def __init__(self, ws: Workspace, key: tuple, meta: FusedMeta, tokens: int) -> None:
        self.ws, self.key, self.meta = ws, key, meta
        self.tokens = tokens  # the call's own rows (key[1], the bucket, may be more)
        self.in_workspace = True
        self.saved: tuple[torch.Tensor, ...] | None = None
        self.counts: torch.Tensor | None = None


class Captured:
    """One captured graph, the workspace it reads and writes, and (forwards) the meta its backward needs."""

    def __init__(self, graph: torch.cuda.CUDAGraph, ws: Workspace, meta: FusedMeta | None) -> None:
        self.graph, self.ws, self.meta = graph, ws, meta
