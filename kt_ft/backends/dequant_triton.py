"""FP8 block dequantization on the GPU in one Triton kernel (``kt_ft.backends.quant.Fp8Block``'s CUDA path).

W[e, r, c] = value(q[e, r, c]) * scale[e, r // 128, c // 128], computed in float32 and rounded once
to the output dtype: the same arithmetic, and so the same bits, as its twin in ``Fp8Block`` (the
e4m3 -> bf16 copy, exact, then the product with the float32 scale rounded once), which takes two
kernels and moves 7 bytes an element (1 read + 2 written, then 2 + 2); this one moves 3. On the GPU
the experts kept quantized are dequantized in every pass of every layer (``grouped_products.base_mm``),
so those bytes are a step cost.

One program per 128 x 128 block of one expert (one scale), rows of ``q`` and ``out`` contiguous;
partial blocks masked. ``available()`` says whether it can run (Triton importable, a CUDA device);
where it cannot, ``Fp8Block`` runs its twin.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 128


@functools.lru_cache(maxsize=1)
def _kernel():
    """The compiled-on-first-call Triton kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:  # why: Triton ships with CUDA builds of torch only
        return None

    @triton.jit
    def fp8_block_dequant(
        q_ptr,
        s_ptr,
        o_ptr,
        rows,
        cols,
        q_se,
        q_sr,
        s_se,
        s_sr,
        o_se,
        o_sr,
        B: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        br, bc, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        r = br * B + tl.arange(0, B)
        c = bc * B + tl.arange(0, B)
        mask = (r < rows)[:, None] & (c < cols)[None, :]
        e64 = e.to(tl.int64)
        r64 = r.to(tl.int64)
        q = tl.load(q_ptr + e64 * q_se + r64[:, None] * q_sr + c[None, :], mask=mask, other=0.0)
        s = tl.load(s_ptr + e64 * s_se + br * s_sr + bc)
        w = q.to(tl.float32) * s
        if OUT_BF16:
            w = w.to(tl.bfloat16, fp_downcast_rounding="rtne")  # as torch rounds
        tl.store(o_ptr + e64 * o_se + r64[:, None] * o_sr + c[None, :], w, mask=mask)

    return fp8_block_dequant


def available(q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether ``dequant_fp8_block`` runs codes ``q`` to ``out_dtype`` here."""
    return q.device.type == "cuda" and out_dtype in (torch.bfloat16, torch.float32) and _kernel() is not None


def dequant_fp8_block(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[e] = value(q[e]) * scale[e] per 128 x 128 block. q float8_e4m3fn [G, R, C], scale fp32
    [G, ceil(R/128), ceil(C/128)], out bf16 / fp32 [G, R, C] (e.g. a row range of a larger buffer);
    rows of q and out contiguous (any row and expert strides), scale's last dim contiguous. All on
    one CUDA device. Returns out."""
    g, rows, cols = q.shape
    want = (g, -(-rows // BLOCK), -(-cols // BLOCK))
    if tuple(scale.shape) != want or tuple(out.shape) != (g, rows, cols):
        raise ValueError(
            f"triton fp8 dequantize: q {tuple(q.shape)}, scale {tuple(scale.shape)} (want {want}), "
            f"out {tuple(out.shape)}"
        )
    if (cols > 1 and (q.stride(2) != 1 or out.stride(2) != 1)) or (want[2] > 1 and scale.stride(2) != 1):
        raise ValueError("triton fp8 dequantize: q, out and scale need contiguous rows")
    if g == 0 or rows == 0 or cols == 0:
        return out
    _kernel()[(want[1], want[2], g)](
        q, scale, out, rows, cols, q.stride(0), q.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1), B=BLOCK, OUT_BF16=out.dtype == torch.bfloat16, num_warps=8,
    )  # fmt: skip
    return out
