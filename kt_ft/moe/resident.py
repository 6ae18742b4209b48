"""GPU-resident experts of one MoE layer: a few experts computed on the training device.

A rule's ``gpu_experts`` names experts of a layer whose frozen base weights are copied once
to the training device (the device of the first ``hidden_states``). Their (token, slot)
pairs are computed there with plain torch ops under autograd; every other pair goes to the
CPU op, which skips the resident ones (their id masked to -1, weight 0: ``kernels/base.py``).

What stays the same whatever the placement: the CPU keeps the full fused base weights (the
checkpoint, merge and convert read them), the expert LoRA stays the six CPU fp32 parameters
of ``KTExperts`` (the device part takes slices of them with ``index_select(...).to(device)``,
so autograd sends its gradients back into the same parameters, the optimizer and the fused
checkpoint see no difference), and the device copies are plain attributes: no new
``nn.Parameter`` or buffer, so state-dict names, PEFT and DDP see nothing new.

Per resident expert e and its pairs (x, w), s the LoRA scaling, in the base weights' dtype:
g = x Wg^T + s (x Ag^T) Bg^T, u = x Wu^T + s (x Au^T) Bu^T, h = act(g, u),
d = h Wd^T + s (h Ad^T) Bd^T, out_t += w d (accumulated in float32; float64 for float64).
The family's layout and activation (``ExpertSpec``: gpt_oss's transposed, interleaved,
biased, clamped experts) are read through ``ExpertWeights.expert`` / ``gated_act``, as the
reference backend does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..kernels.activation import gated_act
from ..kernels.base import ExpertWeights, LoraTensors, accum_dtype
from .function import prefetch_grad_out


class ResidentExperts:
    """Experts ``ids`` of one layer, computed on the training device.

    ``base``: the layer's full CPU base weights (read once, at the first ``to_device``).
    """

    def __init__(self, base: ExpertWeights, ids: Sequence[int]) -> None:
        num = base.num_experts
        bad = [i for i in ids if not 0 <= i < num]
        if bad or len(set(ids)) != len(ids) or not ids:
            raise ValueError(
                f"resident expert ids {list(ids)}: need distinct ids in 0-{num - 1}, at least one"
            )
        self.ids = tuple(sorted(ids))
        self.num_experts = num
        self._cpu_base = base
        self._ids_cpu = torch.tensor(self.ids, dtype=torch.long)
        self.device: torch.device | None = None
        self.weights: ExpertWeights | None = None  # the resident experts only, on self.device
        self._local: torch.Tensor | None = None  # [E] int64 on device: expert id -> resident index, -1

    def to_device(self, device: torch.device) -> None:
        """Copy the resident experts' base weights to ``device`` (once; again only if it changes)."""
        if self.device == device:
            return
        b, idx = self._cpu_base, self._ids_cpu

        def sel(t):
            return None if t is None else t.index_select(0, idx).to(device)

        self.weights = ExpertWeights(
            sel(b.gate_up), sel(b.down), sel(b.gate_up_bias), sel(b.down_bias), spec=b.spec
        )
        local = torch.full((self.num_experts,), -1, dtype=torch.long)
        local[idx] = torch.arange(len(self.ids))
        self._local = local.to(device)
        self.device = device

    def nbytes(self) -> int:
        """Bytes of base weights held on the device (0 before the first ``to_device``)."""
        w = self.weights
        if w is None:
            return 0
        ts = (w.gate_up, w.down, w.gate_up_bias, w.down_bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def split(
        self, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [T, k] int64, weights [T, k] (on the device) -> (local [T, k]: resident index of each
        pair or -1, cpu_ids [T, k]: ids with resident pairs masked to -1, cpu_weights [T, k]: weights
        with resident pairs zeroed -- differentiable, so their gradient there is 0 from the CPU op)."""
        local = self._local[ids]
        resident = local >= 0
        return local, ids.masked_fill(resident, -1), weights.masked_fill(resident, 0)

    def start(
        self, x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, lora: LoraTensors, scaling: float
    ) -> Callable[[], torch.Tensor]:
        """Queue the resident experts' share of the layer output; returns ``finish``, to be called
        after the CPU op, which gives that share attached to the autograd graph.

        x [T, H], local [T, k] (from ``split``), weights [T, k], the layer's full CPU LoRA ->
        ``finish()`` [T, H] float32 (float64 for float64 weights) on x's device, differentiable
        w.r.t. x, weights and lora.

        Why two steps: the share is computed here on a graph of its own (``_ResidentShare``), and
        ``finish`` attaches it to the model's graph *after* the CPU op. Autograd runs the most
        recently created node first, so in the backward the resident experts' kernels are queued
        before the CPU op's backward blocks (and the CPU op's incoming gradient copy is started
        before them): the GPU computes while the CPU does, both ways. One host sync (the
        per-expert pair counts) comes before any product is queued.
        """
        counts, order = self._route(local)
        if sum(counts[1:]) == 0:
            zeros = torch.zeros(x.shape[0], x.shape[1], dtype=accum_dtype(self.dtype), device=x.device)
            return lambda: zeros
        # this layer's LoRA rows of the resident experts on the device; autograd copies their
        # gradients back into the CPU parameters
        lo = [p.index_select(0, self._ids_cpu).to(x.device) for p in lora]
        inputs = (x, weights, *lo)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
            out = self._compute(x, weights, LoraTensors(*lo), scaling, counts, order, local.shape[1])
            return lambda: out
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            out = self._compute(
                leaves[0], leaves[1], LoraTensors(*leaves[2:]), scaling, counts, order, local.shape[1]
            )
        return lambda: _ResidentShare.apply((out, leaves), *inputs)

    @property
    def dtype(self) -> torch.dtype:
        return self._cpu_base.gate_up.dtype

    def _route(self, local: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """(counts: [pairs computed elsewhere, pairs of resident expert 0, 1, ...], order [T*k]: flat
        pair indices sorted by resident index, the others (-1) first)."""
        flat = local.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat + 1, minlength=len(self.ids) + 1).tolist()  # the one host sync
        return counts, order

    def _compute(self, x, weights, lo: LoraTensors, scaling: float, counts: list[int], order, k: int):
        """The formula of the module doc for every resident expert with pairs -> [T, H] accum dtype."""
        dt = self.dtype
        out = torch.zeros(x.shape[0], x.shape[1], dtype=accum_dtype(dt), device=x.device)
        lo = LoraTensors(*(t.to(dt) for t in lo))
        w_flat = weights.reshape(-1)
        xd = x.to(dt)
        off = counts[0]
        for j in range(len(self.ids)):
            c = counts[j + 1]
            if c == 0:
                continue
            pairs = order[off : off + c]
            off += c
            tok = torch.div(pairs, k, rounding_mode="floor")
            xe = xd.index_select(0, tok)
            wg, wu, wd, bg, bu, bd = self.weights.expert(j)
            g = xe @ wg.T + scaling * (xe @ lo.gate_a[j].T) @ lo.gate_b[j].T
            u = xe @ wu.T + scaling * (xe @ lo.up_a[j].T) @ lo.up_b[j].T
            if bg is not None:
                g, u = g + bg, u + bu
            h = gated_act(g, u, self.weights.spec)
            d = h @ wd.T + scaling * (h @ lo.down_a[j].T) @ lo.down_b[j].T
            if bd is not None:
                d = d + bd
            w = w_flat.index_select(0, pairs).to(out.dtype)
            out = out.index_add(0, tok, d.to(out.dtype) * w[:, None])
        return out


class _ResidentShare(torch.autograd.Function):
    """apply((out, leaves), x, weights, *lora slices) -> out: attaches the resident share, computed
    on its own graph from ``leaves`` (detached copies of the inputs), to the model's graph."""

    @staticmethod
    def forward(ctx, inner, *inputs):
        out, leaves = inner
        ctx.inner = inner
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        out, leaves = ctx.inner
        prefetch_grad_out(grad)  # the CPU op's backward (next) gets the same gradient
        want = [t for t in leaves if t.requires_grad]
        # retain_graph: the outer graph may be backwarded more than once (retain_graph=True)
        got = iter(torch.autograd.grad(out, want, grad.to(out.dtype), allow_unused=True, retain_graph=True))
        grads = []
        for t in leaves:
            g = next(got) if t.requires_grad else None
            grads.append(torch.zeros_like(t) if g is None and t.requires_grad else g)
        return None, *grads


def pick_resident_ids(
    num_experts: int, ids: Sequence[int] | None, count: int | None, popularity: torch.Tensor | None = None
) -> tuple[int, ...]:
    """The experts a ``gpu_experts`` entry makes resident: ``ids`` as given, or for a ``count`` the
    ``count`` most popular experts when ``popularity`` [E] (routing counts) is known, else the first
    ``count`` ids (0 .. count-1). Ties keep the lower id. Empty: none."""
    if ids is not None:
        return tuple(sorted(ids))
    if not count:
        return ()
    if popularity is None:
        return tuple(range(count))
    order = sorted(range(num_experts), key=lambda e: (-float(popularity[e]), e))
    return tuple(sorted(order[:count]))
