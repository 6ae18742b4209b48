"""Experts computed on the training device (GPU-resident and streamed ones) with grouped products.

The device share of a layer (``moe/device_experts.py``) holds up to all E experts of the layer.
A Python loop over experts costs ~25 small kernels (and as many autograd nodes) per expert and
pass: measured on the H200 for Qwen3-30B-A3B (128 experts, 2048 tokens, 4 layers), the loop took
~1 s per step where transformers' grouped experts take ~70 ms. Here every projection is one
``torch._grouped_mm`` over the group's experts (rows sorted by expert, ``offs`` the running
row counts, kept on the device: no host sync), differentiated by autograd.

``grouped_mm`` falls back to a loop of ``mm`` over the groups (the reference twin, also used where
``torch._grouped_mm`` refuses the dtype, device or strides: e.g. float64, or float32 on CUDA
builds whose grouped kernel is bf16-only); ``KT_FT_GROUPED_DEVICE=0`` forces the loop.

Shapes: N rows (pairs of the group's experts, sorted by expert), G experts, H hidden, I expert
intermediate, r LoRA rank. The base layout follows ``ExpertWeights.spec`` (``kernels/base.py``).
"""

from __future__ import annotations

import os

import torch

from ..log import get_logger
from .activation import gated_act
from .base import ExpertWeights, LoraTensors

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


def _grouped_enabled() -> bool:
    return os.environ.get("KT_FT_GROUPED_DEVICE", "1") != "0"


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

    ``torch._grouped_mm`` where it runs, else (and with ``KT_FT_GROUPED_DEVICE=0``) the loop."""
    # per product signature: a refusal for one (e.g. a LoRA rank whose rows are not 16-byte
    # aligned) leaves the others grouped
    key = (a.device.type, a.dtype, a.shape[1], tuple(b.shape[1:]), b.stride())
    if _grouped_enabled() and key not in _refused and hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(a, b, offs=groups.offs)
        except (RuntimeError, NotImplementedError) as e:
            # shape/dtype checks raise before any kernel is queued: nothing half-done to undo
            _refused.add(key)
            logger.info(
                f"torch._grouped_mm refused a {a.dtype} [N, {a.shape[1]}] x {list(b.shape[1:])} product on "
                f"{a.device.type} ({str(e).splitlines()[0]}); that product loops over experts"
            )
    return grouped_mm_loop(a, b, groups)


def _t(w: torch.Tensor) -> torch.Tensor:
    """[G, M, K] -> [G, K, M] view."""
    return w.transpose(1, 2)


def grouped_expert_forward(
    x: torch.Tensor, base: ExpertWeights, lora: LoraTensors, scaling: float, groups: Groups
) -> torch.Tensor:
    """Every expert of a group on its rows, differentiable (autograd) w.r.t. x and the LoRA.

    x [N, H] (rows sorted by expert, ``groups.counts`` rows each), ``base`` the group's G experts on
    x's device (``gate_up`` [G, 2I, H], ``down`` [G, H, I]; transposed layouts per ``base.spec``),
    ``lora`` their LoRA slices ([G, r, H], [G, I, r], ..., the compute dtype), s = ``scaling``:
    g = x Wg^T + s (x Ag^T) Bg^T, u = x Wu^T + s (x Au^T) Bu^T, h = act(g, u),
    d = h Wd^T + s (h Ad^T) Bd^T (+ the frozen biases where the family has them) -> d [N, H], x's dtype.
    """
    spec = base.spec
    inter = base.intermediate
    rank = lora.gate_a.shape[1]
    gs, us = spec.gate_up_cols(inter)
    gu = grouped_mm(x, base.gate_up if spec.transposed else _t(base.gate_up), groups)  # [N, 2I]
    if base.gate_up_bias is not None:
        gu = gu + base.gate_up_bias.index_select(0, groups.row_expert)
    # gate and up LoRA A as one product: [Ag; Au] [G, 2r, H]
    p = grouped_mm(x, _t(torch.cat([lora.gate_a, lora.up_a], 1)), groups)  # [N, 2r]
    lo_g = grouped_mm(p[:, :rank].contiguous(), _t(lora.gate_b), groups)  # [N, I]
    lo_u = grouped_mm(p[:, rank:].contiguous(), _t(lora.up_b), groups)
    g = gu[:, gs] + scaling * lo_g
    u = gu[:, us] + scaling * lo_u
    h = gated_act(g, u, spec).contiguous()  # [N, I]
    d = grouped_mm(h, base.down if spec.transposed else _t(base.down), groups)  # [N, H]
    d = d + scaling * grouped_mm(grouped_mm(h, _t(lora.down_a), groups), _t(lora.down_b), groups)
    if base.down_bias is not None:
        d = d + base.down_bias.index_select(0, groups.row_expert)
    return d
