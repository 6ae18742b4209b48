"""Streamed experts: base weights kept in RAM, copied to the training device each time their layer runs.

A rule's ``stream`` names experts of a layer (a count, ids, or ``all``: every expert not
resident) whose frozen base weights stay only in CPU RAM; each time the layer runs they are
copied into one of two reusable device buffers shared by the whole model (double-buffered
across layers) and computed there like resident experts (``device_experts.py``: one formula,
one graph; LoRA as index_select slices of the CPU fp32 parameters).

Copies. A layer's streamed experts are rows of the fused [E, ...] tensors (contiguous per
expert): one copy per run of consecutive ids per tensor, on a dedicated copy stream into the
buffer, then an event the compute stream waits on right before the first streamed expert's
kernels (after the layer's one host sync, so that sync never waits for the copy). A buffer is
refilled only after the kernels reading it (an event recorded after they are queued). The
host source must be page-locked for full link speed (GPU machine: 55 GB/s pinned, 5.6
pageable): the streamed rows of the fused CPU tensors are registered with
``cudaHostRegister`` (only layers that stream; unregistered when the layer is collected or at
exit); if that fails, the reason is logged and the copies go through two pinned staging
buffers instead (one host memcpy more).

Order. A ``StreamScheduler`` per model, shared by its layers, sees every use: a layer's
forward (``KTExperts.forward``: the first pass and a checkpointed recompute alike) and its
backward (the device share's backward). It keeps the order in which layers first ran and the
direction of the last move between two layers, and at each use of layer l queues the copy of
the layer that comes next in that direction (at either end of the order: the turn, l's
neighbour back). So forward prefetches l+1; under reentrant gradient checkpointing the
backward recomputes layers in reverse and the recompute of l prefetches l-1; at the end of
the forward the turn is predicted. Nothing assumes the direction: it is what ran.

Reuse. The buffers keep what they hold (base weights are frozen): a use finds its layer there
when the last two uses were it and its neighbour. A checkpointed layer's backward directly
follows its recompute, so it reuses the recompute's weights (no third copy). Tensors autograd
saves from a buffer are saved as references (``saved_tensor_hooks``) and taken back from
whichever buffer holds the layer at backward time, copying it again if it was evicted (without
checkpointing, every layer but the last two).

On the CPU device (a CPU-only machine, tests) the same buffers and schedule run with plain
synchronous copies: no streams, events or registration; the numbers and the counters are the
same.

Layout. A buffer is bytes: a layer's block holds each stored tensor of its streamed experts (the
weights and biases; for experts kept quantized, ``kt_ft.backends.quant``, their stored tensors: FP8 or
INT4 codes and their scales), rows in the order of the ids, each tensor starting at a multiple
of ``_ALIGN`` bytes and viewed in its own dtype. So quantized experts cross the link in their
stored bytes and are dequantized on the device by the products, a bounded chunk of experts at a
time (``KT_FT_DEQUANT_CHUNK_MIB``, ``backends/grouped_products.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kt_ft.backends.base import ExpertWeights
from kt_ft.backends.quant_weights import is_quantized
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.plan.cost import STREAM_BUFFERS

logger = get_logger(__name__)

TRIGGERS = ("forward", "backward", "prefetch")  # why a copy was issued
_ALIGN = 64  # bytes: where each stored tensor of a block starts in a buffer (any dtype's alignment)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class _Slot:
    """One device buffer: a flat [capacity] uint8 tensor (each layer's block viewed in its dtypes)."""

    buf: torch.Tensor | None = None
    staging: torch.Tensor | None = None  # pinned host twin (fallback when registration fails)
    layer: int | None = None  # whose streamed experts it holds (None: nothing valid)
    ready: Any = None  # CUDA event: the copy into buf has finished (recorded on the copy stream)
    free: Any = None  # CUDA event: recorded after the last kernels reading buf were queued
    tick: int = 0  # last use (least recently used is evicted)
    prefetched: bool = False  # filled by a prefetch that no use has consumed yet


@dataclass(frozen=True)
class _SavedView:
    """A tensor autograd saved from a stream buffer, as a reference: its layout in the layer's block."""

    offset: int  # in elements of dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class StreamScheduler:
    """The device buffers, copy stream and layer order shared by one model's streamed layers."""

    def __init__(self, num_slots: int = STREAM_BUFFERS) -> None:
        self.layers: dict[int, StreamedExperts] = {}
        self.order: list[int] = []  # layers in the order they first ran
        self._pos: dict[int, int] = {}
        self.last: int | None = None
        self.direction = 1  # +1: the last move went up the order, -1: down
        self.slots = [_Slot() for _ in range(num_slots)]
        self.device: torch.device | None = None
        self.copy_stream = None
        self._tick = 0
        self.copies = 0  # block copies issued (one per layer fill)
        self.bytes_streamed = 0
        self.prefetch_hits = 0  # uses that found their layer filled by a prefetch
        self.hits = 0  # uses that found their layer already in a buffer (prefetch hits included)
        self.copies_by: Counter[str] = Counter()  # trigger -> copies

    def register(self, layer: StreamedExperts) -> None:
        if layer.layer in self.layers:
            raise ValueError(f"layer {layer.layer} registered twice with the stream scheduler")
        self.layers[layer.layer] = layer

    def unregister(self, layer: StreamedExperts) -> None:
        """``layer`` streams no more (the re-planner changed its split): forget it, its place in the
        order and any buffer holding it; unpin its rows. Between steps only."""
        if self.layers.get(layer.layer) is layer:
            del self.layers[layer.layer]
            self.order = [k for k in self.order if k != layer.layer]
            self._pos = {k: i for i, k in enumerate(self.order)}
            if self.last == layer.layer:
                self.last = None
            for s in self.slots:
                if s.layer == layer.layer:
                    s.layer, s.prefetched = None, False
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # a queued prefetch may still read its pinned rows
        layer.close()

    @property
    def capacity(self) -> int:
        """Bytes of one buffer: the largest layer's streamed block."""
        return max((la.nbytes for la in self.layers.values()), default=0)

    def buffer_bytes(self) -> int:
        """Device bytes of the buffers once allocated (len(slots) x the largest layer's block)."""
        return len(self.slots) * self.capacity

    def _setup(self, device: torch.device) -> None:
        if self.device == device and all(
            s.buf is not None and s.buf.numel() >= self.capacity for s in self.slots
        ):
            return
        if self.device is not None and self.device != device:
            raise RuntimeError(
                f"streamed experts ran on {self.device} and now on {device}: one training device per model"
            )
        self.device = device
        cuda = device.type == "cuda"
        if cuda and self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device)
        for s in self.slots:
            s.buf = torch.empty(self.capacity, dtype=torch.uint8, device=device)
            s.layer, s.prefetched = None, False
            if cuda:
                s.ready, s.free = torch.cuda.Event(), torch.cuda.Event()
                # the allocator may hand out memory that kernels queued earlier on this stream
                # still use: the first copy into it (on the copy stream) waits for them
                s.free.record(torch.cuda.current_stream(device))
        logger.info(
            f"streamed experts: {len(self.layers)} layers share {len(self.slots)} device buffers of "
            f"{fmt_bytes(self.buffer_bytes() // len(self.slots))} on {device}"
        )

    # --- the order -------------------------------------------------------------------------

    def _note(self, key: int) -> None:
        if key not in self._pos:
            self._pos[key] = len(self.order)
            self.order.append(key)
        if self.last is not None and key != self.last:
            self.direction = 1 if self._pos[key] > self._pos[self.last] else -1
        self.last = key

    def predict(self, key: int) -> int | None:
        """The layer expected to run after ``key``: its neighbour in the current direction, or at
        an end of the order the neighbour back (the turn); None when it is the only layer."""
        i = self._pos[key]
        for d in (self.direction, -self.direction):
            if 0 <= i + d < len(self.order):
                return self.order[i + d]
        return None

    # --- buffers ---------------------------------------------------------------------------

    def _holding(self, key: int) -> _Slot | None:
        return next((s for s in self.slots if s.layer == key), None)

    def _victim(self, exclude: _Slot | None) -> _Slot:
        return min((s for s in self.slots if s is not exclude), key=lambda s: (s.layer is not None, s.tick))

    def visit(self, layer: StreamedExperts, device: torch.device, trigger: str) -> None:
        """A use of ``layer``'s streamed weights begins (``trigger``: forward or backward): make
        sure they are (being) copied in, then queue the copy of the layer predicted next."""
        self._setup(device)
        self._note(layer.layer)
        slot = self._holding(layer.layer)
        if slot is not None:
            self.hits += 1
            layer.hits += 1
            if slot.prefetched:
                self.prefetch_hits += 1
                layer.prefetch_hits += 1
        slot = self.acquire(layer, trigger)
        nxt = self.predict(layer.layer)
        if nxt is not None and self._holding(nxt) is None and len(self.slots) > 1:
            self._copy(self.layers[nxt], self._victim(exclude=slot), "prefetch")

    def acquire(self, layer: StreamedExperts, trigger: str) -> _Slot:
        """The buffer holding ``layer`` (copied in now if none does), marked as in use."""
        slot = self._holding(layer.layer)
        if slot is None:
            slot = self._victim(exclude=None)
            self._copy(layer, slot, trigger)
        self._tick += 1
        slot.tick = self._tick
        slot.prefetched = False
        return slot

    def wait_ready(self, slot: _Slot) -> None:
        """Make the current stream wait (on the device, not the host) for the copy into ``slot``."""
        if slot.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)

    def used(self, layer: StreamedExperts) -> None:
        """Kernels reading ``layer``'s buffer have been queued: a refill must wait for them."""
        slot = self._holding(layer.layer)
        if slot is not None and slot.free is not None:
            slot.free.record(torch.cuda.current_stream(self.device))

    def _copy(self, layer: StreamedExperts, slot: _Slot, trigger: str) -> None:
        slot.layer, slot.prefetched = layer.layer, trigger == "prefetch"
        if slot.ready is None:  # the CPU device: a plain synchronous copy
            layer.copy_into(slot.buf, None, non_blocking=False)
        else:
            staging = None
            if not layer.pin():
                if slot.staging is None or slot.staging.numel() < self.capacity:
                    slot.staging = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
                slot.ready.synchronize()  # the last copy out of this staging buffer has finished
                staging = slot.staging
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(slot.free)  # the kernels reading the old contents
                layer.copy_into(slot.buf, staging, non_blocking=True)
                slot.ready.record(self.copy_stream)
        nbytes = layer.nbytes
        self.copies += 1
        self.bytes_streamed += nbytes
        self.copies_by[trigger] += 1
        layer.copies += 1
        layer.bytes_streamed += nbytes
        layer.copies_by[trigger] += 1

    def stats(self) -> dict[str, Any]:
        """Totals over the model's streamed layers (a benchmark or a test reads them)."""
        return {
            "copies": self.copies,
            "bytes_streamed": self.bytes_streamed,
            "hits": self.hits,
            "prefetch_hits": self.prefetch_hits,
            "copies_by": dict(self.copies_by),
            "buffer_bytes": self.buffer_bytes(),
        }


class StreamedExperts:
    """Experts ``ids`` of one layer, streamed from the layer's CPU base weights ``base`` through the
    model's ``scheduler``. Their block in a buffer: gate_up [S, ...], down [S, ...], then the
    biases [S, ...] where the family has them, in the order of ``ids`` (S = len(ids)); a weight
    kept quantized is its stored tensors there (each [S, ...] in its dtype). Counters: ``copies``,
    ``bytes_streamed``, ``hits``, ``prefetch_hits``, ``copies_by``."""

    def __init__(
        self, layer: int, base: ExpertWeights, ids: Sequence[int], scheduler: StreamScheduler
    ) -> None:
        num = base.num_experts
        bad = [i for i in ids if not 0 <= i < num]
        if bad or len(set(ids)) != len(ids) or not ids:
            raise ValueError(
                f"streamed expert ids {list(ids)}: need distinct ids in 0-{num - 1}, at least one"
            )
        self.layer = layer
        self.ids = tuple(sorted(ids))
        self.base = base
        self.scheduler = scheduler
        parts = (base.gate_up, base.down, base.gate_up_bias, base.down_bias)
        self._quant = {i: t for i, t in enumerate(parts) if is_quantized(t)}
        # the stored tensors, [E, ...] each: (which of ``parts``, (part index, key) of a quantized
        # weight's stored tensor or None, the tensor)
        self._parts: list[tuple[int, tuple[int, str] | None, torch.Tensor]] = []
        for i, t in enumerate(parts):
            if t is None:
                continue
            if i in self._quant:
                for j, stored in enumerate(t.parts):
                    self._parts += [(i, (j, key), v) for key, v in stored.items()]
            else:
                self._parts.append((i, None, t))
        self.dtype = base.gate_up.dtype  # the compute dtype
        n = len(self.ids)
        self._offsets, off = [], 0  # bytes
        for _, _, t in self._parts:
            self._offsets.append(off)
            off = _aligned(off + n * t[0].numel() * t.element_size())
        self.nbytes = off
        runs: list[list[int]] = []  # [first expert id, first local index, length]
        for j, e in enumerate(self.ids):
            if runs and runs[-1][0] + runs[-1][2] == e:
                runs[-1][2] += 1
            else:
                runs.append([e, j, 1])
        self._runs = [tuple(r) for r in runs]
        self._pinned: bool | None = None  # None: not tried yet
        self._finalizer: weakref.finalize | None = None
        self.copies = 0
        self.bytes_streamed = 0
        self.hits = 0
        self.prefetch_hits = 0
        self.copies_by: Counter[str] = Counter()
        scheduler.register(self)

    # --- layout ----------------------------------------------------------------------------

    def _views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each stored tensor's block in the uint8 ``buf``, viewed [S, ...] in its dtype."""
        n = len(self.ids)
        out = []
        for (_, _, t), off in zip(self._parts, self._offsets):
            nbytes = n * t[0].numel() * t.element_size()
            out.append(buf[off : off + nbytes].view(t.dtype).view(n, *t.shape[1:]))
        return out

    def view(self, buf: torch.Tensor) -> ExpertWeights:
        """The streamed experts as ExpertWeights over ``buf`` (no copy; quantized weights as
        ``QuantizedExperts`` over their stored tensors there)."""
        parts: list = [None] * 4
        stored: dict[int, list[dict[str, torch.Tensor]]] = {
            i: [{} for _ in q.parts] for i, q in self._quant.items()
        }
        for (i, where, _), v in zip(self._parts, self._views(buf)):
            if where is None:
                parts[i] = v
            else:
                stored[i][where[0]][where[1]] = v
        for i, q in self._quant.items():
            parts[i] = q.like(stored[i])
        return ExpertWeights(*parts, spec=self.base.spec)

    def copy_into(self, buf: torch.Tensor, staging: torch.Tensor | None, non_blocking: bool) -> None:
        """Copy the streamed experts' rows (one copy per run of consecutive ids per tensor) into
        ``buf``, straight from the CPU tensors, or through the pinned host ``staging`` buffer."""
        dst_views = self._views(buf)
        via = self._views(staging) if staging is not None else dst_views
        for (_, _, t), dst in zip(self._parts, via):
            for e, j, m in self._runs:
                dst[j : j + m].copy_(t[e : e + m], non_blocking=non_blocking and staging is None)
        if staging is not None:
            buf[: self.nbytes].copy_(staging[: self.nbytes], non_blocking=non_blocking)

    # --- host memory -----------------------------------------------------------------------

    def pin(self) -> bool:
        """Page-lock the streamed rows of the fused CPU tensors (once; True when they are).
        A failure is logged once with its reason; the copies then go through pinned staging."""
        if self._pinned is None:
            self._pinned, reason = _register(self)
            if not self._pinned:
                logger.warning(
                    f"layer {self.layer}: cannot page-lock the streamed experts' RAM ({reason}); their copies "
                    "go through pinned staging buffers (one host memcpy more per copy)"
                )
        return self._pinned

    def close(self) -> None:
        """Unregister the page-locked host memory (also done when this object is collected)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer, self._pinned = None, None  # a later copy registers again

    # --- uses --------------------------------------------------------------------------------

    def begin(self, device: torch.device) -> None:
        """The layer's forward (first pass or recompute) starts on ``device``."""
        self.scheduler.visit(self, device, "forward")

    def begin_backward(self) -> None:
        """The layer's device-share backward starts."""
        self.scheduler.visit(self, self.scheduler.device, "backward")

    def weights(self) -> ExpertWeights:
        """The streamed experts on the device, the current stream waiting for their copy."""
        slot = self.scheduler.acquire(self, "forward")
        self.scheduler.wait_ready(slot)
        return self.view(slot.buf)

    def done(self) -> None:
        self.scheduler.used(self)

    @contextlib.contextmanager
    def saved_tensor_hooks(self) -> Iterator[None]:
        """Inside: tensors autograd saves from a stream buffer are kept as ``_SavedView`` references
        and taken back, at backward, from the buffer holding this layer then (copied in again
        if evicted), so no buffer is pinned by a pending backward."""
        sched = self.scheduler
        ptrs = {s.buf.untyped_storage().data_ptr() for s in sched.slots if s.buf is not None}

        def pack(t: torch.Tensor):
            if t.device == sched.device and t.untyped_storage().data_ptr() in ptrs:
                return _SavedView(t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            return t

        def unpack(p):
            if not isinstance(p, _SavedView):
                return p
            slot = sched.acquire(self, "backward")
            sched.wait_ready(slot)
            return slot.buf.view(p.dtype).as_strided(p.size, p.stride, p.offset)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def stats(self) -> dict[str, Any]:
        return {
            "ids": list(self.ids),
            "copies": self.copies,
            "bytes_streamed": self.bytes_streamed,
            "hits": self.hits,
            "prefetch_hits": self.prefetch_hits,
            "copies_by": dict(self.copies_by),
        }


# --- page-locking the CPU tensors -------------------------------------------------------------

_REGISTERED: dict[int, int] = {}  # data_ptr -> bytes, every range this process registered


def _register(layer: StreamedExperts) -> tuple[bool, str]:
    """cudaHostRegister the byte range of each fused tensor that holds ``layer``'s streamed
    rows (first to last streamed expert). (True, "") or (False, why); on a failure the ranges
    registered so far are unregistered."""
    lo, hi = layer.ids[0], layer.ids[-1] + 1
    ranges = []
    for _, _, t in layer._parts:
        region = t[lo:hi]
        if t.device.type != "cpu" or not region.is_contiguous():
            return (
                False,
                f"a fused expert tensor is {'not on the CPU' if t.device.type != 'cpu' else 'not contiguous'}",
            )
        if is_page_locked(region):
            continue  # already page-locked (e.g. allocated pinned)
        ranges.append((region.data_ptr(), region.numel() * region.element_size()))
    try:
        cudart = torch.cuda.cudart()
    except (RuntimeError, AssertionError) as e:
        return False, f"no CUDA runtime: {e}"
    done: list[int] = []
    for ptr, nbytes in ranges:
        err = cudart.cudaHostRegister(ptr, nbytes, 0)  # 0: cudaHostRegisterDefault
        if err != cudart.cudaError.success:
            why = f"cudaHostRegister of {fmt_bytes(nbytes)}: {cudart.cudaGetErrorString(err)}"
            _clear_cuda_error()
            _unregister(done)
            return False, why
        done.append(ptr)
        _REGISTERED[ptr] = nbytes
    # unregister when the layer goes away (the tensors are kept alive until then) or at exit
    layer._finalizer = weakref.finalize(layer, _unregister, done, [t for _, _, t in layer._parts])
    return True, ""


def _unregister(ptrs: list[int], keep_alive: Any = None) -> None:
    if not ptrs:
        return
    try:
        cudart = torch.cuda.cudart()
        for ptr in ptrs:
            if _REGISTERED.pop(ptr, None) is not None:
                cudart.cudaHostUnregister(ptr)
    except Exception as e:  # noqa: BLE001 - at interpreter exit CUDA may be gone: nothing left to free
        logger.debug(f"cudaHostUnregister skipped: {e}")
    ptrs.clear()


@functools.cache
def _cudart_lib() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded (found by soname among the loaded libraries), or None."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def is_page_locked(t: torch.Tensor) -> bool:
    """Whether ``t``'s first byte is page-locked host memory (allocated pinned or
    ``cudaHostRegister``-ed): ``cudaHostGetFlags`` succeeds only there. ``Tensor.is_pinned`` is not
    enough: some torch builds answer only for their own pinned allocator."""
    if t.is_pinned():
        return True
    lib = _cudart_lib()
    if lib is None or not torch.cuda.is_available():
        return False
    flags = ctypes.c_uint()
    if lib.cudaHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(t.data_ptr())) != 0:
        lib.cudaGetLastError()  # reset the error it leaves behind (see _clear_cuda_error)
        return False
    return True


def _clear_cuda_error() -> None:
    """A failed runtime call leaves CUDA's per-thread 'last error' set, which torch's next kernel
    launch check would raise as its own: read it once (cudaGetLastError resets it)."""
    lib = _cudart_lib()
    if lib is not None:
        lib.cudaGetLastError()
        return
    logger.warning("could not reset CUDA's last error after a failed cudaHostRegister (libcudart not found)")
