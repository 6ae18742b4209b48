"""Gated activations of the routed experts, h = act(g, u), and their hand-written derivatives.

``silu``: h = silu(g) * u (most families).
``gelu_tanh`` / ``gelu``: h = gelu(g) * u, tanh approximation (transformers' ``gelu_pytorch_tanh``,
e.g. Gemma 4's experts) or exact erf (``gelu``).
``gpt_oss_clamped`` (transformers' ``GptOssExperts._apply_gate``, line by line):
gc = min(g, limit), uc = clamp(u, -limit, limit), h = (uc + 1) * gc * sigmoid(alpha * gc).
Its derivative follows torch's clamp: the gradient passes where limit is not exceeded
(g <= limit, -limit <= u <= limit, bounds included) and is zero beyond.

All functions take g, u [N, I] (any strides, e.g. interleaved column views) in the compute
dtype and return tensors of that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kt_ft.backends.base import ExpertSpec

# ExpertSpec.activation -> F.gelu's ``approximate``
_GELU = {"gelu_tanh": "tanh", "gelu": "none"}


def gated_act(g: torch.Tensor, u: torch.Tensor, spec: ExpertSpec) -> torch.Tensor:
    """h [N, I] = act(g, u); differentiable by autograd (the reference backend uses it)."""
    if spec.activation == "silu":
        return F.silu(g) * u
    if spec.activation in _GELU:
        return F.gelu(g, approximate=_GELU[spec.activation]) * u
    gc = g.clamp(max=spec.limit)
    uc = u.clamp(min=-spec.limit, max=spec.limit)
    return (uc + 1) * (gc * torch.sigmoid(gc * spec.alpha))


def gated_act_backward(
    dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, spec: ExpertSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) [N, I] for upstream dh [N, I]: the gradients of act(g, u) w.r.t. g and u."""
    if spec.activation == "silu":
        return torch.ops.aten.silu_backward(dh * u, g), dh * F.silu(g)
    if spec.activation in _GELU:
        approx = _GELU[spec.activation]
        return torch.ops.aten.gelu_backward(dh * u, g, approximate=approx), dh * F.gelu(g, approximate=approx)
    a, lim = spec.alpha, spec.limit
    gc = g.clamp(max=lim)
    uc = u.clamp(min=-lim, max=lim)
    sig = torch.sigmoid(gc * a)
    glu = gc * sig
    # d glu / d gc = sig + a * gc * sig * (1 - sig); zero where the clamp cut g (g > limit)
    dg = (dh * (uc + 1) * (sig + a * glu * (1 - sig))).masked_fill_(g > lim, 0)
    # d h / d uc = glu; zero where the clamp cut u (|u| > limit)
    du = (dh * glu).masked_fill_(u.abs() > lim, 0)
    return dg, du


def gated_act_into(g: torch.Tensor, u: torch.Tensor, spec: ExpertSpec, out: torch.Tensor) -> torch.Tensor:
    """``gated_act`` written into ``out`` [N, I] (any row stride, e.g. the left columns of a wider
    buffer), no autograd. Why: the fused device share keeps h beside other columns; writing it there
    saves a copy of [N, I] a pass (a strided copy kernel per layer-pass on the GPU)."""
    if spec.activation == "silu":
        return torch.mul(F.silu(g), u, out=out)
    if spec.activation in _GELU:
        return torch.mul(F.gelu(g, approximate=_GELU[spec.activation]), u, out=out)
    return out.copy_(gated_act(g, u, spec))


def gated_act_backward_into(
    dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, spec: ExpertSpec, dg: torch.Tensor, du: torch.Tensor
) -> None:
    """``gated_act_backward`` written into ``dg`` and ``du`` [N, I] (any row strides: the gate and up
    columns of one [N, 2I] buffer), no autograd: silu and gelu in 4 kernels and no copies (the
    plain function's results took 2 strided copies into the buffer); the clamped variant copies."""
    if spec.activation == "silu":
        torch.mul(dh, u, out=dg)
        torch.ops.aten.silu_backward.grad_input(dg, g, grad_input=dg)  # in place: elementwise
        torch.ops.aten.silu.out(g, out=du)
        du.mul_(dh)
    elif spec.activation in _GELU:
        approx = _GELU[spec.activation]
        torch.mul(dh, u, out=dg)
        torch.ops.aten.gelu_backward.grad_input(dg, g, approximate=approx, grad_input=dg)
        torch.ops.aten.gelu.out(g, approximate=approx, out=du)
        du.mul_(dh)
    else:
        a, b = gated_act_backward(dh, g, u, spec)
        dg.copy_(a), du.copy_(b)
