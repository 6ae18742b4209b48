"""PEFT's LoRA linear layers as one autograd node: y = x W^T (+ bias) + s (x A^T) B^T.

Why: the training step is bound by the host's per-operator work (docs/benchmarks.md). PEFT's
``lora.Linear.forward`` makes ~8 operators and as many autograd nodes a call under autocast (the
base product, x cast to the LoRA's fp32 and back, A and B cast, two products, the scaling, the
add), and ~12 kernels in the backward. The same arithmetic as one ``autograd.Function``: 5
kernels forward (A and B cast, three products, the LoRA term accumulated onto the base product
by ``addmm_``), 8 backward, one node. The parameters and their names stay PEFT's, so checkpoints,
merging and export are unchanged.

Numerics: the products run in the dtype PEFT's would under the same autocast (bf16 in
LLaMA-Factory's bf16 recipes); the LoRA term is added inside the product's fp32 accumulator
instead of rounded to bf16 first, so outputs differ from PEFT's by rounding only (tests state
the tolerance). ``KT_FT_FUSIONS`` without ``lora`` keeps PEFT's forward.

A layer takes the fused path only where it is plain LoRA (one active adapter, no dropout, DoRA,
LoRA bias or other variant, an ``nn.Linear`` base with a frozen weight, not merged); a call with
adapter names, disabled adapters or mixed dtypes without autocast goes through PEFT's own forward.
"""

from __future__ import annotations

import types
from collections import Counter

import torch
import torch.nn.functional as F

from kt_ft.base.log import get_logger
from kt_ft.base.settings import fusions

logger = get_logger(__name__)


class FusedLoRALinear(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T, products in ``dtype``.

    x [..., in] (any float dtype); weight [out, in], bias [out] or None (frozen); lora_a [r, in],
    lora_b [out, r] (trainable, any float dtype); returns [..., out] in ``dtype``. Gradients: x
    (in x's dtype), lora_a and lora_b (in their own dtypes).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, dtype: torch.dtype):
        # every call here costs the host a dispatch (the step is host-bound): no-op casts are skipped in Python
        lead = x.shape[:-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.dtype == dtype else x2.to(dtype)
        w = weight if weight.dtype == dtype else weight.to(dtype)
        a = lora_a if lora_a.dtype == dtype else lora_a.to(dtype)
        b = lora_b if lora_b.dtype == dtype else lora_b.to(dtype)
        if bias is not None and bias.dtype != dtype:
            bias = bias.to(dtype)
        xa = F.linear(x2, a)  # [N, r]
        y = F.linear(x2, w, bias)  # [N, out]
        y.addmm_(xa, b.t(), alpha=scaling)  # the LoRA term inside the product's accumulator
        ctx.save_for_backward(x2, w, a, b, xa)
        ctx.scaling, ctx.x_dtype, ctx.a_dtype, ctx.b_dtype = scaling, x.dtype, lora_a.dtype, lora_b.dtype
        ctx.x_shape = x.shape
        return y.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, w, a, b, xa = ctx.saved_tensors
        s = ctx.scaling
        g = grad if grad.dim() == 2 else grad.reshape(-1, grad.shape[-1])  # [N, out]
        g = g if g.dtype == x2.dtype else g.to(x2.dtype)
        gb = g @ b  # [N, r]: the gradient at x A^T, before the scaling
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            dx = g @ w  # [N, in]
            dx.addmm_(gb, a, alpha=s)
            dx = dx.view(ctx.x_shape)
            dx = dx if dx.dtype == ctx.x_dtype else dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[3]:
            da = (gb.t() @ x2).to(ctx.a_dtype).mul_(s)  # [r, in]
        if ctx.needs_input_grad[4]:
            db = (g.t() @ xa).to(ctx.b_dtype).mul_(s)  # [out, r]
        return dx, None, None, da, db, None, None


def _plain_reason(module) -> str | None:
    """Why a PEFT LoRA linear cannot take the fused path for good (None: it can)."""
    base = module.base_layer
    if type(base) is not torch.nn.Linear:
        return f"base layer {type(base).__name__}"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "trainable base weight"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out"
    if len(module.lora_A) != 1:
        return "several adapters"
    (name,) = module.lora_A.keys()
    if getattr(module, "lora_variant", {}).get(name) is not None or module.use_dora.get(name, False):
        return "a LoRA variant (DoRA, ...)"
    if getattr(module, "lora_bias", {}).get(name, False) or module.lora_B[name].bias is not None:
        return "LoRA bias"
    drop = module.lora_dropout[name]
    if not (isinstance(drop, torch.nn.Identity) or (isinstance(drop, torch.nn.Dropout) and drop.p == 0)):
        return "LoRA dropout"
    return None


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A PEFT ``lora.Linear``'s forward through FusedLoRALinear where the call is plain LoRA."""
    name = self._kt_ft_adapter
    if args or kwargs or self.disable_adapters or self.merged or self.active_adapters != [name]:
        return self._kt_ft_peft_forward(x, *args, **kwargs)
    base = self.base_layer
    lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
    elif x.dtype == base.weight.dtype == lora_a.dtype == lora_b.dtype:
        dtype = x.dtype
    else:  # PEFT's own promotion rules for mixed dtypes without autocast
        return self._kt_ft_peft_forward(x, *args, **kwargs)
    return FusedLoRALinear.apply(x, base.weight, base.bias, lora_a, lora_b, self.scaling[name], dtype)


def install_fused_lora(model: torch.nn.Module) -> tuple[int, Counter]:
    """Give every plain PEFT LoRA linear of ``model`` the fused forward (module doc).

    Returns (layers fused, Counter of reasons the others were not); logs one line. A no-op (0)
    when ``KT_FT_FUSIONS`` leaves out ``lora``, or without PEFT.
    """
    skipped: Counter = Counter()
    if "lora" not in fusions():
        return 0, skipped
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return 0, skipped
    fused = 0
    for module in model.modules():
        if type(module) is not LoraLinear or hasattr(module, "_kt_ft_adapter"):
            continue
        reason = _plain_reason(module)
        if reason is not None:
            skipped[reason] += 1
            continue
        (module._kt_ft_adapter,) = module.lora_A.keys()
        module._kt_ft_peft_forward = module.forward  # PEFT's bound forward, for the calls it keeps
        module.forward = types.MethodType(_fused_forward, module)
        fused += 1
    if fused or skipped:
        why = "; ".join(f"{n} with {r}" for r, n in skipped.most_common())
        logger.info(
            f"LoRA linears: {fused} of {fused + sum(skipped.values())} through one fused autograd node "
            f"(KT_FT_FUSIONS without lora: PEFT's forward)"
            + (f"; PEFT's forward kept for {why}" if why else "")
        )
    return fused, skipped
