"""Resident experts' base weights stored with their expert LoRA beside them: the LoRA's B products
and their adds folded into the base products.

The expert LoRA of one projection is two rank-sized products around the base one: x Wg^T + s (x A^T) B^T.
On the GPU each rank-sized grouped product costs nearly a base product's fixed time, and its
[pairs, 2I] or [pairs, H] output must then be added to the base output (measured on an H100, one
Qwen3-30B-A3B layer, 2,048 tokens: the down projection's LoRA B product 0.106 ms and the base product
0.228 ms; kt-ft's checkpointed layer 4.9 ms against transformers' LoRA-free 3.6 ms). Appending rows
to the base weight (one product giving x W^T and x A^T together) saves nothing: those products are
cheap. Appending columns folds the expensive ones into the base product's inner dimension:
[x | p] [W | s B]^T = x W^T + s p B^T, one product whose K grows by 2r (about 1%).

Layout (per expert; the default row-major spec, dense weights, H, I and r multiples of 8 so every
row of the buffers and activations stays 16-byte aligned for ``torch._grouped_mm``):

    gate_up  [2I + 2r, H + 2r]:  [ W_gu  | s B_gu ]      down  [H + r, I + r]:  [ W_d | s B_d ]
                                 [ A_gu  |   0    ]                             [ A_d |   0   ]

A_gu = [Ag; Au] [2r, H]; B_gu [2I, 2r] holds Bg in the gate rows' first r columns and Bu in the up
rows' last r (zeros elsewhere, exact), as ``grouped_device.stack_lora`` lays them out. The forward
reads each buffer's top rows ([W | s B]), the backward its left columns ([W; A]):

    forward   pa = xs A_gu^T;  gu = [xs | pa] [W_gu | s B_gu]^T        (= xs W_gu^T + s pa B_gu^T)
              pd = h A_d^T;    d  = [h | pd]  [W_d | s B_d]^T
    backward  ts = gd (s B_d); dh = [gd | ts] [W_d; A_d]                 (= gd W_d + s (gd B_d) A_d)
              dpa = dgu (s B_gu); dx = [dgu | dpa] [W_gu; A_gu]

So a forward has 4 grouped products instead of 6 and a backward 8 instead of 10 (4 of them the
LoRA's weight gradients), none followed by a [pairs, H]- or [pairs, 2I]-sized add. The LoRA part of the buffers is rewritten from the
parameters at every forward (``load_lora``: ~1% of the weights' bytes; a layer replaying CUDA
graphs does it before a forward whose LoRA changed, outside the graphs: ``moe/graphed.py``), so it
always holds the values the step's forward and backward read. The buffer's zero corner is never read.
"""

from __future__ import annotations

import torch

from kt_ft.backends.base import ExpertSpec

ALIGN = 8  # elements: 16 bytes of bf16, the row alignment torch._grouped_mm asks of its operands


def wide_fits(spec: ExpertSpec, hidden: int, inter: int, rank: int, quantized: bool) -> bool:
    """Whether resident experts of these sizes are kept in the wide layout: a row-major spec
    (gpt-oss's transposed one stays plain), dense weights, and H, I and r multiples of ``ALIGN``."""
    return (
        not spec.transposed
        and not quantized
        and rank > 0
        and all(n % ALIGN == 0 for n in (hidden, inter, rank))
    )


def wide_extra_bytes(hidden: int, inter: int, rank: int, weight_bytes: int) -> int:
    """Bytes one expert's wide buffers hold beyond its base weights (the LoRA blocks and the zero
    corners): (2r H + 2I 2r + 4r^2) + (r I + H r + r^2) values."""
    h, i, r = hidden, inter, rank
    return (2 * r * h + 4 * i * r + 4 * r * r + r * i + h * r + r * r) * weight_bytes


class WideExperts:
    """The wide buffers of a group of G experts on one device.

    ``gu_buf`` [G, 2I + 2r, H + 2r] and ``d_buf`` [G, H + r, I + r] in the weights' dtype. Views:
    ``gate_up`` [G, 2I, H] and ``down`` [G, H, I] (the base weights, strided), and the blocks the
    products read (``gu_rows``, ``gu_cols``, ``a_gu``, ``b_gu``, ``d_rows``, ``d_cols``, ``a_d``,
    ``b_d``)."""

    def __init__(
        self, gu_buf: torch.Tensor, d_buf: torch.Tensor, hidden: int, inter: int, rank: int, spec
    ) -> None:
        self.gu_buf, self.d_buf = gu_buf, d_buf
        self.hidden, self.inter, self.rank, self.spec = hidden, inter, rank, spec
        h, i = hidden, inter
        self.gate_up = gu_buf[:, : 2 * i, :h]
        self.down = d_buf[:, :h, :i]
        self.gu_rows = gu_buf[:, : 2 * i]  # [G, 2I, H + 2r]: [W_gu | s B_gu]
        self.gu_cols = gu_buf[:, :, :h]  # [G, 2I + 2r, H]: [W_gu; A_gu]
        self.a_gu = gu_buf[:, 2 * i :, :h]  # [G, 2r, H]
        self.b_gu = gu_buf[:, : 2 * i, h:]  # [G, 2I, 2r], scaled
        self.d_rows = d_buf[:, :h]  # [G, H, I + r]: [W_d | s B_d]
        self.d_cols = d_buf[:, :, :i]  # [G, H + r, I]: [W_d; A_d]
        self.a_d = d_buf[:, h:, :i]  # [G, r, I]
        self.b_d = d_buf[:, :h, i:]  # [G, H, r], scaled

    @classmethod
    def from_weights(
        cls, gate_up: torch.Tensor, down: torch.Tensor, rank: int, spec, device, ids=None
    ) -> WideExperts:
        """Wide buffers on ``device`` holding experts ``ids`` (default all) of ``gate_up`` [E, 2I, H]
        and ``down`` [E, H, I] (any device), the LoRA blocks zero until ``load_lora``. Copied an
        expert at a time: no second copy of the group's weights on the device (a run under a GPU
        memory cap has no room) nor on the host."""
        ids = range(gate_up.shape[0]) if ids is None else ids
        g, (two_i, h) = len(ids), gate_up.shape[1:]
        i, r = two_i // 2, rank
        gu_buf = torch.empty(g, two_i + 2 * r, h + 2 * r, dtype=gate_up.dtype, device=device)
        d_buf = torch.empty(g, h + r, i + r, dtype=down.dtype, device=device)
        gu_buf[:, two_i:].zero_()
        gu_buf[:, :two_i, h:].zero_()
        d_buf[:, h:].zero_()
        d_buf[:, :h, i:].zero_()
        for j, e in enumerate(ids):
            gu_buf[j, :two_i, :h].copy_(gate_up[e])
            d_buf[j, :h, :i].copy_(down[e])
        return cls(gu_buf, d_buf, h, i, r, spec)

    @torch.no_grad()  # a buffer write, never part of a graph: ``LayerGraphs`` calls it in grad mode too
    def load_lora(self, ga, gb, ua, ub, da, db, scaling: float) -> None:
        """Write the group's LoRA (fp32 [G, r, H], [G, I, r], [G, r, H], [G, I, r], [G, r, I], [G, H, r])
        into the buffers, in their dtype, B scaled by ``scaling``."""
        r, i = self.rank, self.inter
        gs, us = self.spec.gate_up_cols(i)
        self.a_gu[:, :r].copy_(ga)
        self.a_gu[:, r:].copy_(ua)
        self.b_gu[:, gs, :r].copy_(gb * scaling)
        self.b_gu[:, us, r:].copy_(ub * scaling)
        self.a_d.copy_(da)
        self.b_d.copy_(db * scaling)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two buffers (what a backward saves and a CUDA graph reads)."""
        return self.gu_buf, self.d_buf

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
