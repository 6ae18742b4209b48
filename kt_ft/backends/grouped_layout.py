"""How a call's (token, slot) pairs are laid out for the grouped backends: sorted by expert, each
expert's rows padded to ``ROW_PAD``, experts grouped by padded row count (``grouped.py``'s module
doc says why). Shared by the plain path (``grouped.py``, ``grouped_parallel.py``) and the variant
experts' path (``grouped_variant.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_PAD = 16  # AMX tile height; also bounds the number of distinct GEMM shapes


def _expert_slices(counts: list[int]):
    off = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(off, off + n)
        off += n


@dataclass
class _Group:
    """Experts ``experts`` (n of them) with ``c`` rows each, their rows ``rows`` (n·c, contiguous)."""

    experts: list[int]
    rows: slice
    n: int
    c: int
    _idx: torch.Tensor | None = None

    @property
    def idx(self) -> torch.Tensor:
        """[n] int64 of ``experts``, made on first use (groups of one never need it)."""
        if self._idx is None:
            self._idx = torch.tensor(self.experts, dtype=torch.long)
        return self._idx

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """[N, X] -> this group's rows as [n, c, X] (a view)."""
        return t[self.rows].view(self.n, self.c, t.shape[1])

    def pick(self, w: torch.Tensor) -> torch.Tensor:
        """[E, ...] -> the group's experts [n, ...] (a view for one expert, else a copy)."""
        if self.n == 1:
            e = self.experts[0]
            return w[e : e + 1]
        return w.index_select(0, self.idx)

    def put(self, dst: torch.Tensor, val: torch.Tensor) -> None:
        """Write ``val`` [n, ...] into the group's experts of ``dst`` [E, ...]."""
        if self.n == 1:
            e = self.experts[0]
            dst[e : e + 1].copy_(val)
        else:
            dst.index_copy_(0, self.idx, val)


@dataclass
class _Layout:
    """Where each expert's rows are: ``counts`` padded rows per expert id, ``slices`` (expert,
    rows) in row order, ``groups`` runs of experts with equal counts (``_Group``), ``rows`` the
    experts' rows in all (a null row may follow)."""

    counts: list[int]
    slices: list[tuple[int, slice]]
    groups: list[_Group]
    rows: int
    used: list[int] | None = None  # rows per expert id before padding (its others are padding)


def _layout(padded: list[int], order: list[int], batched: bool) -> _Layout:
    """Rows of experts in ``order`` (each ``padded[e]`` rows); ``batched`` False: one expert a group."""
    slices, groups, off = [], [], 0
    run: list[int] = []

    def close():
        if run:
            c = padded[run[0]]
            start = slices[-len(run)][1].start
            groups.append(_Group(list(run), slice(start, start + c * len(run)), len(run), c))
            run.clear()

    for e in order:
        c = padded[e]
        if not c:
            continue
        if run and (not batched or padded[run[0]] != c):
            close()
        slices.append((e, slice(off, off + c)))
        run.append(e)
        off += c
    close()
    return _Layout(padded, slices, groups, off)


def _route(ids: torch.Tensor, weights: torch.Tensor, num_experts: int):
    """``_route_layout`` with the experts' rows in id order; returns its counts for the layout."""
    tok, inv, ws, layout = _route_layout(ids, weights, num_experts, by_count=False)
    return tok, inv, ws, layout.counts


def _route_layout(
    ids: torch.Tensor, weights: torch.Tensor, num_experts: int, by_count: bool = True, row_pad: int = ROW_PAD
):
    """Sort the T*k (token, slot) pairs by expert, each expert's rows padded to ``row_pad``.

    Pairs with a negative id are *masked* (computed elsewhere, e.g. by GPU-resident experts):
    they get no row of their own; all of them point at one extra "null" row after the experts'
    rows, which no expert product writes and which the caller zeroes (``_zero_null_rows``), so
    they add nothing to the output and get zero input, routing-weight and LoRA gradients.

    ``by_count``: the experts' rows ordered by padded row count (then id), so experts with equal
    counts are adjacent and share a group (``_Layout.groups``); else by id, one expert a group.

    Returns (tok [N] token per row, inv [T*k] row of each flat pair, ws [N, 1] routing
    weight per row with 0 on padding rows, the ``_Layout``); N = the layout's rows, plus 1 (the
    null row, last) when some pair is masked.
    """
    flat = ids.reshape(-1)
    n = flat.numel()
    keep = None
    if bool((flat < 0).any()):
        keep = torch.nonzero(flat >= 0).squeeze(1)  # flat indices of the pairs computed here
        flat = flat[keep]
    m = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + row_pad - 1) // row_pad * row_pad
    start = torch.cumsum(counts, 0) - counts  # first sorted pair of each expert
    ar = torch.arange(num_experts)
    # the experts in row order: by padded count (stable: ties by id), or by id
    e_order = torch.argsort(padded, stable=True) if by_count else ar
    in_order = padded[e_order]
    start_pad = torch.empty_like(padded)
    start_pad[e_order] = torch.cumsum(in_order, 0) - in_order  # first row of each expert
    expert = flat[order]
    row = start_pad[expert] + torch.arange(m) - start[expert]  # row of each sorted pair
    if keep is not None:
        order = keep[order]  # back to indices among all T*k pairs
    n_rows = int(padded.sum()) + (keep is not None)
    tok = torch.zeros(n_rows, dtype=torch.long)
    tok[row] = torch.div(order, ids.shape[1], rounding_mode="floor")
    ws = torch.zeros(n_rows, 1, dtype=weights.dtype)
    ws[row, 0] = weights.reshape(-1)[order]
    inv = torch.full((n,), n_rows - 1, dtype=torch.long)  # masked pairs: the null row
    inv[order] = row
    layout = _layout(padded.tolist(), e_order.tolist(), by_count)
    layout.used = counts.tolist()
    return tok, inv, ws, layout


def _zero_null_rows(t: torch.Tensor, counts: list[int]) -> None:
    """Zero the rows past the experts' rows (the null row of masked pairs, if any)."""
    t[sum(counts) :] = 0
