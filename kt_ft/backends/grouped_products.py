"""Grouped products over the rows of a group of experts on the training device.

Rows sorted by expert (``Groups``: each expert's row count, kept on the device), each expert's
rows times its own matrix: one ``torch._grouped_mm`` (``offs`` the running row counts, so no host
sync) where it runs, else a loop of ``mm`` over the experts (``grouped_mm_loop``, the reference
twin: where ``torch._grouped_mm`` refuses the dtype, device or strides, e.g. float64, or float32
on CUDA builds whose grouped kernel is bf16-only, or a torch without it). A refusal is per product
signature and logged once. ``base_mm`` multiplies by the frozen base weights, dequantizing weights
kept quantized a chunk of experts at a time (``KT_FT_DEQUANT_CHUNK_MIB``); ``grouped_mm_k`` gives
the per-expert weight gradients (offsets along K). What the products compute, and their
autograd node, is ``grouped_device.py``'s.
"""

from __future__ import annotations

import torch

from kt_ft.base.log import get_logger
from kt_ft.base.settings import positive_number

logger = get_logger(__name__)

_refused: set[tuple] = set()  # product signatures torch._grouped_mm refused once


class Groups:
    """Rows per expert of one group: ``counts_dev`` [G] int64 on the rows' device (for ``offs``),
    ``rows`` their sum, ``counts`` the same on the host when known (else read from the device, a
    sync, only by the loop)."""

    def __init__(self, counts_dev: torch.Tensor, rows: int, counts: list[int] | None = None) -> None:
        self.counts_dev = counts_dev
        self.rows = rows
        self._counts = counts
        self._offs: torch.Tensor | None = None
        self._row_expert: torch.Tensor | None = None

    @property
    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = self.counts_dev.tolist()
        return self._counts

    @property
    def offs(self) -> torch.Tensor:
        """[G] int32: end row of each expert (``torch._grouped_mm``'s ``offs``)."""
        if self._offs is None:
            self._offs = torch.cumsum(self.counts_dev, 0, dtype=torch.int32)
        return self._offs

    @property
    def row_expert(self) -> torch.Tensor:
        """[N] int64: the group-local expert of each row (gathers per-expert biases)."""
        if self._row_expert is None:
            g = self.counts_dev.shape[0]
            ar = torch.arange(g, device=self.counts_dev.device)
            self._row_expert = torch.repeat_interleave(ar, self.counts_dev, output_size=self.rows)
        return self._row_expert


def sort_by_id(flat: torch.Tensor, n: int) -> torch.Tensor:
    """[N] int64: the stable order that sorts ``flat`` [N] (integer ids in -1..n-1) by id.

    The keys are narrowed to the smallest integer type that holds the range first: a GPU radix
    sort takes one pass per key byte, so int64 ids cost 8 passes (and their kernels, inside every
    CUDA graph of ``runtime/graphed.py``) where up to 128 experts need 1 and up to 32,768 need 2."""
    dt = torch.int8 if n <= 128 else torch.int16 if n <= 32768 else flat.dtype
    return torch.argsort(flat.to(dt), stable=True)


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Reference twin of ``grouped_mm``: one ``mm`` per expert with rows. a [N, K], b [G, K, M] ->
    [N, M] (a's dtype); differentiable."""
    parts, off = [], 0
    for e, c in enumerate(groups.counts):
        if c:
            parts.append(a[off : off + c] @ b[e])
        off += c
    if not parts:
        return a.new_zeros(a.shape[0], b.shape[-1])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """rows of expert e of ``a`` [N, K] times ``b[e]`` [K, M] -> [N, M], for b [G, K, M] (any strides,
    e.g. a transposed view of [G, M, K] weights); differentiable w.r.t. a and b.

    ``torch._grouped_mm`` where it runs, else the loop."""
    # per product signature: a refusal for one (e.g. a LoRA rank whose rows are not 16-byte
    # aligned) leaves the others grouped
    key = (a.device.type, a.dtype, a.shape[1], tuple(b.shape[1:]), b.stride())
    out = _try_grouped(key, a, b, groups, lambda: f"[N, {a.shape[1]}] x {list(b.shape[1:])}")
    return grouped_mm_loop(a, b, groups) if out is None else out


def _try_grouped(key: tuple, a: torch.Tensor, b: torch.Tensor, groups: Groups, what) -> torch.Tensor | None:
    """``torch._grouped_mm(a, b, offs)`` unless it is missing or refused this signature
    ``key`` before (a refusal is logged once, ``what()`` naming the product: made only then, as
    the step is bound by host time and this runs ~20 times a layer and pass); None: loop instead."""
    if key in _refused or not hasattr(torch, "_grouped_mm"):
        return None
    try:
        return torch._grouped_mm(a, b, offs=groups.offs)
    except (RuntimeError, NotImplementedError) as e:
        if _in_capture():
            # an error inside a CUDA graph capture (the capture's, or one an earlier op left) is
            # no refusal of the signature: marking it refused would loop this product, and stop
            # every layer's graphs, for the rest of the run. The capture's caller falls back.
            raise
        # shape/dtype checks raise before any kernel is queued: nothing half-done to undo
        _refused.add(key)
        logger.info(
            f"torch._grouped_mm refused a {a.dtype} {what()} product on {a.device.type} "
            f"({str(e).splitlines()[0]}); that product loops over experts"
        )
        return None


def _in_capture() -> bool:
    """Whether the current CUDA stream is capturing a graph (a capture an error invalidated counts
    too). Asked only after an error, so it costs the step nothing."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _t(w: torch.Tensor) -> torch.Tensor:
    """[G, M, K] -> [G, K, M] view."""
    return w.transpose(1, 2)


def base_mm(a: torch.Tensor, w, groups: Groups, transpose: bool) -> torch.Tensor:
    """Rows of expert e of ``a`` [N, K] times the frozen base weight of e: ``w[e]^T`` (``transpose``,
    w [G, M, K]: the forward products of the default layout, the backward ones of a transposed
    layout) or ``w[e]`` (w [G, K, M]: the other way round) -> [N, M].

    Dense weights: one grouped product (``grouped_mm``). Weights kept quantized
    (``kt_ft.backends.quant_weights.QuantizedExperts``, on the device in their stored form): a chunk of experts at a
    time (``dequant_chunks``), dequantized on the device into one buffer right before the chunk's
    grouped product over its rows and dropped after it, so a layer's experts are dense there at
    most ``KT_FT_DEQUANT_CHUNK_MIB`` at a time (or one expert, if larger)."""
    if getattr(w, "fmt", None) is None:
        return grouped_mm(a, _t(w) if transpose else w, groups)
    g, m_dim = w.shape[0], w.shape[1] if transpose else w.shape[2]
    chunks = dequant_chunks(g, w.shape[1] * w.shape[2] * w.dtype.itemsize)
    if len(chunks) == 1:  # the whole group at once: no row counts needed on the host (no sync)
        wc = w.experts(0, g)
        return grouped_mm(a, _t(wc) if transpose else wc, groups)
    counts = groups.counts  # a chunk's rows: read from the device once (a sync) unless known
    out = a.new_empty(a.shape[0], m_dim)
    row = 0
    for lo, hi in chunks:
        rows = sum(counts[lo:hi])
        if rows:
            wc = w.experts(lo, hi)
            sub = Groups(groups.counts_dev[lo:hi], rows, counts[lo:hi])
            out[row : row + rows] = grouped_mm(a[row : row + rows], _t(wc) if transpose else wc, sub)
            del wc
        row += rows
    return out


def dequant_chunks(experts: int, expert_bytes: int) -> list[tuple[int, int]]:
    """(lo, hi) expert ranges covering 0..experts, each dequantized at once by ``base_mm``: as many
    experts as ``KT_FT_DEQUANT_CHUNK_MIB`` holds at ``expert_bytes`` each (at least one)."""
    per = max(1, int(positive_number("KT_FT_DEQUANT_CHUNK_MIB") * 2**20) // max(1, expert_bytes))
    return [(lo, min(lo + per, experts)) for lo in range(0, experts, per)]


def grouped_mm_k(a_t: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Per-expert products over each expert's rows: a_t [M, N] (a transposed view of [N, M] rows
    sorted by expert), b [N, P] -> [G, M, P], expert e's block a_t[:, rows_e] @ b[rows_e] (zeros for
    an expert without rows): the weight gradients of the grouped products. Not differentiable.
    ``torch._grouped_mm`` with offsets along K where it runs, else a loop (its reference twin)."""
    key = ("k", a_t.device.type, a_t.dtype, a_t.shape[0], b.shape[1])
    out = _try_grouped(
        key, a_t, b, groups, lambda: f"weight-gradient [{a_t.shape[0]}, N] x [N, {b.shape[1]}]"
    )
    if out is not None:
        return out
    out = a_t.new_zeros(len(groups.counts), a_t.shape[0], b.shape[1])
    off = 0
    for e, c in enumerate(groups.counts):
        if c:
            out[e] = a_t[:, off : off + c] @ b[off : off + c]
        off += c
    return out
