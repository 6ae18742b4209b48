"""Frozen bf16 products in fp32 on CPUs without native bf16 arithmetic.

On such a CPU (AVX2, no AVX512-BF16 or AMX) torch's bf16 matmul runs ~5x slower than its fp32
one. Where the non-expert part of a run is on the CPU (a machine without a GPU), the products
outside the routed experts then dominate a step: the loss's ``lm_head`` product (DeepSeek-V3's is
129280 x 7168) and the linear layers kept quantized. ``KT_FT_CPU_UPCAST`` (default 1) computes them
in fp32 instead: the weight upcast (or dequantized) a block of rows at a time, the activations
upcast once, the result rounded to the model's dtype where the model expects it. Memory: one fp32
block of the weight at a time (``BLOCK_BYTES``), never an fp32 copy of the model.

Numerics: the product's inputs are the same bf16 values; fp32 sums instead of oneDNN's bf16
products with fp32 accumulation and a bf16 result, so results differ by bf16 rounding (the tests
state the tolerance).
"""

from __future__ import annotations

import functools

import torch

from kt_ft.backends.native_backend import cpu_has_native_bf16
from kt_ft.base.log import get_logger
from kt_ft.base.settings import enabled

logger = get_logger(__name__)

BLOCK_BYTES = 128 * 2**20  # fp32 bytes of one upcast block of a weight's rows
LOW = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def _cpu_lacks_bf16() -> bool:
    return not cpu_has_native_bf16()


@functools.lru_cache(maxsize=1)
def _say_once() -> None:
    logger.info(
        "this CPU has no native bf16 arithmetic: the loss's lm_head product and the linear layers kept "
        "quantized run in fp32 from their bf16 / stored weights, a block at a time (KT_FT_CPU_UPCAST=0: bf16)"
    )


def upcasts(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a product with a frozen weight of ``dtype`` on ``device`` runs in fp32 (module doc)."""
    up = device.type == "cpu" and dtype in LOW and enabled("KT_FT_CPU_UPCAST") and _cpu_lacks_bf16()
    if up:
        _say_once()
    return up


def block_rows(weight: torch.Tensor) -> int:
    """Rows of ``weight`` [R, C] upcast at a time."""
    return max(1, BLOCK_BYTES // (4 * max(1, weight.shape[1])))


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, C] @ weight [R, C]^T (+ bias) -> [N, R] float32, weight upcast ``block_rows`` rows at a
    time (x upcast once)."""
    with torch.autocast("cpu", enabled=False):
        xf = x.float()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        step = block_rows(weight)
        for r in range(0, weight.shape[0], step):
            out[:, r : r + step] = xf @ weight[r : r + step].float().t()
        if bias is not None:
            out += bias.float()
    return out


def mm_fp32(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a [N, R] @ weight [R, C] -> [N, C] float32, weight upcast ``block_rows`` rows at a time."""
    with torch.autocast("cpu", enabled=False):
        af = a.float()
        out = torch.zeros(a.shape[0], weight.shape[1], dtype=torch.float32, device=a.device)
        step = block_rows(weight)
        for r in range(0, weight.shape[0], step):
            out.addmm_(af[:, r : r + step], weight[r : r + step].float())
    return out
