"""A frozen linear layer kept in its stored quantized form: DeepSeek-V3's FP8 attention, dense MLP
and shared-expert projections stay FP8 on the GPU (half their bf16 bytes) instead of being
dequantized at load.

``QuantizedLinear`` is an ``nn.Linear`` (so LLaMA-Factory's ``lora_target: all`` and PEFT's LoRA
wrap it as any linear layer) whose weight is dequantized, in the training dtype, inside each call
and dropped after it: the forward computes ``x W^T + b`` with ``W = fmt.dequantize(stored)``, the
backward ``grad W`` for the input gradient with ``W`` dequantized again (the weight is frozen: no
weight gradient, nothing of size [out, in] kept between the passes). The values are those
``dequantize_other_weights`` would have written into a bf16 weight (the same ``dequantize``), so the
numbers equal a load that dequantizes.

Its ``weight`` parameter holds the first stored tensor (the codes) viewed as ``uint8``: a floating
dtype there would make PEFT cast the LoRA to it (FP8 LoRA), and PEFT only reads its device. The
other stored tensors (scales) are buffers. Shapes and dtypes follow ``formats.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kt_ft.backends import cpu_fp32
from kt_ft.backends.quant import QuantFormat


class QuantizedLinear(nn.Linear):
    """y [..., out] = x [..., in] W^T + b, W [out, in] dequantized from ``stored`` each call.

    ``stored``: {name: tensor} as ``fmt.stored(out, in)`` lays them out; ``bias`` [out] or None
    (kept as given, frozen); ``dtype``: the dtype W is dequantized to (the training dtype)."""

    def __init__(
        self,
        fmt: QuantFormat,
        stored: dict[str, torch.Tensor],
        *,  # sizes by name: out and in are easy to swap
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a [out, in] weight
        self.in_features, self.out_features = in_features, out_features
        self.fmt = fmt
        self.compute_dtype = dtype
        names = [s.name for s in fmt.stored(out_features, in_features)]
        missing = [n for n in names if n not in stored]
        if missing:
            raise ValueError(f"QuantizedLinear: {fmt.name} needs stored tensors {names}; missing {missing}")
        self._first = (names[0], stored[names[0]].dtype)
        self.weight = nn.Parameter(stored[names[0]].contiguous().view(torch.uint8), requires_grad=False)
        self._others = list(names[1:])
        for n in self._others:
            self.register_buffer(_buffer(n), stored[n])
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def stored(self) -> dict[str, torch.Tensor]:
        """The stored tensors, in their own dtypes, on the module's device."""
        first, dt = self._first
        out = {first: self.weight.view(dt)}
        for n in self._others:
            out[n] = getattr(self, _buffer(n))
        return out

    def dequantized(self) -> torch.Tensor:
        """W [out, in] in ``compute_dtype`` (a new tensor each call)."""
        return self.fmt.dequantize(self.stored(), self.compute_dtype)

    def stored_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored().values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuantLinear.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"stored={self.fmt.name}, computes in {str(self.compute_dtype).removeprefix('torch.')}"
        )


def _buffer(name: str) -> str:
    return "q_" + name.replace(".", "_")


class _QuantLinear(torch.autograd.Function):
    """apply(x, weight (the codes: for the graph's bookkeeping only), bias, module) -> y; the
    backward dequantizes W again for the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.module = module
        dt = module.compute_dtype
        # on a CPU without bf16 arithmetic: W dequantized to fp32, the product in fp32 (KT_FT_CPU_UPCAST)
        ctx.up = cpu_fp32.upcasts(x.device, dt)
        if ctx.up:
            w = module.fmt.dequantize(module.stored(), torch.float32)
            with torch.autocast("cpu", enabled=False):
                return F.linear(x.float(), w, None if bias is None else bias.float()).to(dt)
        w = module.dequantized()
        return F.linear(x.to(w.dtype), w, None if bias is None else bias.to(w.dtype))

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        module = ctx.module
        if ctx.up:
            w = module.fmt.dequantize(module.stored(), torch.float32)
            with torch.autocast("cpu", enabled=False):
                return (grad.float() @ w).to(module.compute_dtype), None, None, None
        w = module.dequantized()
        return grad.to(w.dtype) @ w, None, None, None
