"""Reference backend: a plain loop over experts, differentiated by autograd.

This is the ground truth every fast backend is tested against. It is slow on purpose: it
follows the formula in ``base.py`` line by line, with nothing fused or reordered.
"""

from __future__ import annotations

from typing import Any

import torch

from kt_ft.backends.activation import gated_act
from kt_ft.backends.base import ExpertBackend, ExpertWeights, LoraTensors, accum_dtype


def reference_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    base: ExpertWeights,
    lora: LoraTensors,
    scaling: float,
) -> torch.Tensor:
    """Routed-expert output [T, H] in float32, differentiable w.r.t. x, weights and lora.

    Everything is computed in x's dtype; per-expert outputs are accumulated in float32
    (float64 for float64 inputs). ``base.spec`` says the layout, biases and activation
    (default: silu(g) * u, no biases).
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=accum_dtype(x.dtype), device=x.device)
    dt = x.dtype
    for e in range(base.num_experts):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        # per-projection views of expert e whatever the family's layout (base.expert), biases or None
        wg, wu, wd, bg, bu, bd = (None if t is None else t.to(dt) for t in base.expert(e))
        g = xe @ wg.T + scaling * (xe @ lora.gate_a[e].to(dt).T) @ lora.gate_b[e].to(dt).T
        u = xe @ wu.T + scaling * (xe @ lora.up_a[e].to(dt).T) @ lora.up_b[e].to(dt).T
        if bg is not None:
            g, u = g + bg, u + bu
        h = gated_act(g, u, base.spec)
        d = h @ wd.T + scaling * (h @ lora.down_a[e].to(dt).T) @ lora.down_b[e].to(dt).T
        if bd is not None:
            d = d + bd
        out = out.index_add(0, tok, d.to(out.dtype) * weights[tok, slot].to(out.dtype)[:, None])
    return out


class ReferenceBackend(ExpertBackend):
    name = "reference"

    def forward(self, x, ids, weights, base, lora, scaling, needs_grad) -> tuple[torch.Tensor, Any]:
        if not needs_grad:
            with torch.no_grad():
                return reference_moe(x, ids, weights, base, lora, scaling), None
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (x, weights, *lora)]
            out = reference_moe(leaves[0], ids, leaves[1], base, LoraTensors(*leaves[2:]), scaling)
        return out.detach(), (out, leaves)

    def backward(self, ctx, grad_out):
        out, leaves = ctx
        # retain_graph: the outer graph may be backwarded more than once (gradcheck, retain_graph=True)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True, retain_graph=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
        acc = out.dtype
        return grads[0].to(acc), grads[1].to(acc), LoraTensors(*(g.to(acc) for g in grads[2:]))
