"""Work computed on an autograd graph of its own and joined to the model's graph later.

kt-ft queues GPU work (device experts, shared experts beside the CPU op) before the CPU op blocks,
but attaches its result to the model's graph after the CPU op, so the backward keeps that order
(``device_experts._DeviceShare``, ``beside._AttachBeside``). Such a Function keeps the inner
graph in ``ctx.inner`` and differentiates it in its backward.

The inner graph is released by that backward (not ``retain_graph``): a retained inner graph
keeps its saved activations until the *whole* backward ends, so every layer's would be alive at
once at its end (measured on the CPU: all of them still held when the backward reaches the
model's input). A second backward through the same graph is therefore refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def take_inner(ctx: Any, what: str) -> Any:
    """``ctx.inner``, once; a second backward through the same graph raises."""
    inner = getattr(ctx, "inner", None)
    if inner is None:
        raise RuntimeError(
            f"kt-ft {what}: a second backward through the same graph is not supported (its inner graph "
            "is released by the first backward to free memory); run the forward again"
        )
    ctx.inner = None
    return inner


def inner_grads(
    out: torch.Tensor, leaves: Sequence[torch.Tensor], grad: torch.Tensor, zeros_for_unused: bool = False
) -> list[torch.Tensor | None]:
    """Gradients of ``out`` (upstream ``grad``) for each of ``leaves`` that requires one (None for the
    others; where ``out`` does not depend on it: None, or zeros with ``zeros_for_unused``); releases
    the inner graph."""
    want = [t for t in leaves if t.requires_grad]
    got = iter(torch.autograd.grad(out, want, grad, allow_unused=True) if want else ())
    grads: list[torch.Tensor | None] = []
    for t in leaves:
        g = next(got) if t.requires_grad else None
        grads.append(torch.zeros_like(t) if g is None and t.requires_grad and zeros_for_unused else g)
    return grads
