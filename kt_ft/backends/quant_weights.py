"""A routed-expert weight kept quantized in RAM: stands where a fused [E, rows, cols] tensor would.

``QuantizedExperts`` holds one fused expert parameter (``gate_up_proj`` [E, 2I, H] or
``down_proj`` [E, H, I]) as the stored tensors of its parts (gate and up for ``gate_up_proj``,
each stacked over experts on dim 0, exactly the bytes of the files). The CPU backends read it one
expert at a time: ``w[e]`` dequantizes expert e only, to [rows, cols] in the compute dtype (a
backend's temporary is one expert's bf16 weight); the GPU's grouped products read a bounded chunk
of experts at once (``experts(lo, hi)``), so a layer is never dequantized whole unless it fits
that bound.

It answers what the backends ask of a fused tensor (``shape``, ``dtype``: the compute dtype,
``device``, ``[e]`` with an int) and nothing else: any other indexing raises, so code that
would read a whole layer at once fails loudly instead of materialising it.

``transposed``: the fused tensor it stands for is the transpose of the stored weights, [E, cols,
rows] (gpt-oss: ``gate_up_proj`` [E, H, 2I] is stored MXFP4 as [E, 2I, H/32, 16], rows in its
interleaved gate/up order); ``[e]`` is then a transposed view of the dequantized [rows, cols].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kt_ft.backends.quant import QuantFormat


class QuantizedExperts:
    """One fused expert weight [E, rows, cols], stored quantized.

    ``parts``: per part (rows stacked in this order, e.g. gate then up), {suffix: tensor stacked
    over experts [E, ...]}; ``part_rows``: each part's rows; ``cols``: the input size;
    ``dtype``: the dtype ``[e]`` returns (the training dtype); ``transposed``: it stands for
    [E, cols, rows] (module doc).
    """

    def __init__(
        self,
        fmt: QuantFormat,
        parts: list[dict[str, torch.Tensor]],
        part_rows: list[int],
        cols: int,
        dtype: torch.dtype,
        transposed: bool = False,
    ) -> None:
        if len(parts) != len(part_rows) or not parts:
            raise ValueError("QuantizedExperts: one row count per part, at least one part")
        self.fmt = fmt
        self.parts = parts
        self.part_rows = list(part_rows)
        self.cols = cols
        self.dtype = dtype
        self.transposed = transposed
        self.num_experts = next(iter(parts[0].values())).shape[0]

    @classmethod
    def from_dense(cls, fmt: QuantFormat, w: torch.Tensor, parts: int = 1) -> QuantizedExperts:
        """A fused weight ``w`` [E, rows, cols] stored in ``fmt`` as kt-ft loads one: ``parts`` equal
        row blocks (2 for ``gate_up_proj``: gate then up), each expert's block quantized on its own;
        computes in ``w``'s dtype. (The op bench and the tests make their quantized layers so.)"""
        rows = w.shape[1] // parts
        stacked = []
        for i in range(parts):
            per = [fmt.quantize(w[e, i * rows : (i + 1) * rows]) for e in range(w.shape[0])]
            stacked.append({k: torch.stack([q[k] for q in per]) for k in per[0]})
        return cls(fmt, stacked, [rows] * parts, w.shape[2], w.dtype)

    @property
    def shape(self) -> torch.Size:
        rows = sum(self.part_rows)
        return torch.Size((self.num_experts, *((self.cols, rows) if self.transposed else (rows, self.cols))))

    def dim(self) -> int:
        return 3

    @property
    def ndim(self) -> int:
        return 3

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts[0].values())).device

    @property
    def requires_grad(self) -> bool:
        return False  # frozen base

    def nbytes(self) -> int:
        """Bytes held (the stored tensors: what RAM holds for this weight)."""
        return sum(t.numel() * t.element_size() for p in self.parts for t in p.values())

    def dequantize_bytes(self) -> int:
        """Bytes the same weight takes in ``dtype`` (for the log's comparison)."""
        return self.shape.numel() * self.dtype.itemsize

    def expert(self, e: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert e dequantized: [rows, cols] in ``dtype`` (default ``self.dtype``); its [cols, rows]
        transposed view when ``transposed``."""
        dt = dtype or self.dtype
        ws = [self.fmt.dequantize({k: t[e] for k, t in p.items()}, dt) for p in self.parts]
        w = ws[0] if len(ws) == 1 else torch.cat(ws, 0)
        return w.t() if self.transposed else w

    def experts(
        self, lo: int, hi: int, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Experts lo..hi-1 dequantized at once: [hi - lo, rows, cols] in ``dtype`` (default
        ``self.dtype``), each part written into its rows of one buffer (``QuantFormat.dequantize_many``;
        ``out``: that buffer, [hi - lo, rows, cols] contiguous, else a new one); the [hi - lo, cols,
        rows] transposed view when ``transposed``. For the grouped products, which take a chunk of
        experts this way (``backends/grouped_products.py``: the chunk's size bounded by
        ``KT_FT_DEQUANT_CHUNK_MIB``; ``kernels/grouped.py`` on the CPU)."""
        dt = dtype or self.dtype
        rows = sum(self.part_rows)
        shape = (hi - lo, rows, self.cols)
        if out is not None and (tuple(out.shape) != shape or out.dtype != dt or not out.is_contiguous()):
            raise ValueError(
                f"QuantizedExperts.experts: out {tuple(out.shape)} {out.dtype}, want {shape} {dt}"
            )
        w = torch.empty(shape, dtype=dt, device=self.device) if out is None else out
        r = 0
        for p, n in zip(self.parts, self.part_rows, strict=True):
            self.fmt.dequantize_many({k: t[lo:hi] for k, t in p.items()}, dt, out=w[:, r : r + n])
            r += n
        return w.transpose(1, 2) if self.transposed else w

    def like(self, parts: list[dict[str, torch.Tensor]]) -> QuantizedExperts:
        """The same weight's description (format, rows, cols, dtype, orientation) over other stored
        tensors ``parts`` (a subset of experts, another device, a stream buffer's views)."""
        return QuantizedExperts(self.fmt, parts, self.part_rows, self.cols, self.dtype, self.transposed)

    def __getitem__(self, e) -> torch.Tensor:
        if isinstance(e, torch.Tensor) and e.numel() == 1 and not e.is_floating_point():
            e = int(e)
        if not isinstance(e, int):
            raise TypeError(
                f"quantized expert weights are read one expert at a time (w[e] with an int e), got {e!r}: "
                "dequantizing a whole layer at once is what they exist to avoid"
            )
        return self.expert(e)

    def select(self, ids: list[int] | tuple[int, ...]) -> QuantizedExperts:
        """The experts ``ids`` only (a copy of their stored bytes)."""
        idx = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        return self.like([{k: t.index_select(0, idx) for k, t in p.items()} for p in self.parts])

    def to(self, device: torch.device | str) -> QuantizedExperts:
        """The stored tensors on ``device`` (still quantized: the bytes that cross the link)."""
        return self.like([{k: t.to(device) for k, t in p.items()} for p in self.parts])

    def leaves(self) -> list[torch.Tensor]:
        """The stored tensors, parts in order, keys in their order (``rebuild_quantized``'s input)."""
        return [t for p in self.parts for t in p.values()]

    def leaves_structure(self) -> tuple[tuple, int]:
        """(what ``rebuild_quantized`` needs besides the leaves, how many leaves)."""
        keys = [tuple(p) for p in self.parts]
        return (self.fmt, keys, self.part_rows, self.cols, self.dtype, self.transposed), sum(
            len(k) for k in keys
        )

    def dequantize_all(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole fused weight [E, rows, cols] in ``dtype``: export and tests only."""
        dt = dtype or self.dtype
        out = torch.empty(self.shape, dtype=dt, device=self.device)
        for e in range(self.num_experts):
            out[e] = self.expert(e, dt)
        return out

    def __repr__(self) -> str:
        return (
            f"QuantizedExperts({self.fmt.name}, shape={tuple(self.shape)}, parts={self.part_rows}, "
            f"{'stored transposed, ' if self.transposed else ''}computes in {self.dtype})"
        )


def rebuild_quantized(structure: tuple, leaves: Sequence[torch.Tensor]) -> QuantizedExperts:
    """A ``QuantizedExperts`` from ``leaves_structure()[0]`` and tensors in ``leaves()``'s order
    (autograd saves the stored tensors of a quantized weight one by one)."""
    fmt, keys, part_rows, cols, dtype, transposed = structure
    parts, i = [], 0
    for ks in keys:
        parts.append(dict(zip(ks, leaves[i : i + len(ks)], strict=True)))
        i += len(ks)
    return QuantizedExperts(fmt, parts, part_rows, cols, dtype, transposed)


def is_quantized(t) -> bool:
    return isinstance(t, QuantizedExperts)


def stored_nbytes(t) -> int:
    """Bytes a base weight holds: a tensor's, or a ``QuantizedExperts``' stored tensors'."""
    return t.nbytes() if is_quantized(t) else t.numel() * t.element_size()
