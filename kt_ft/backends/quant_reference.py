"""Plain dequantizers, the twins of ``formats.py``'s: written the slow, obvious way (a loop over
128x128 blocks, over groups of 32, over the eight nibbles of a word with integer division; fp4
values decoded from their sign, exponent and mantissa bits instead of a table) so a test
comparing the two checks the vectorised path against an independent reading of the layout.
"""

from __future__ import annotations

import torch

from kt_ft.backends.quant import FP8_BLOCK, INT4_GROUP, MXFP4_GROUP


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/128), ceil(in/128)] -> float32 [out, in]."""
    out, inp = q.shape
    w = torch.empty(out, inp, dtype=torch.float32)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            r = slice(bi * FP8_BLOCK, min(out, (bi + 1) * FP8_BLOCK))
            c = slice(bj * FP8_BLOCK, min(inp, (bj + 1) * FP8_BLOCK))
            w[r, c] = q[r, c].to(torch.float32) * float(scale_inv[bi, bj])
    return w


def unpack_int4(packed: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """packed int32 [out, ceil(in/8)] -> q int64 [out, in] in [-8, 7] (code j of a word in bits
    4j..4j+3, stored as q + 8)."""
    words = packed.to(torch.int64) % 2**32  # the unsigned value of each word
    q = torch.empty(out, words.shape[1] * 8, dtype=torch.int64)
    for j in range(8):
        q[:, j::8] = (words // 16**j) % 16 - 8
    return q[:, :inp]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized int4, group 32 -> float32 [out, in]."""
    out, inp = int(shape[0]), int(shape[1])
    q = unpack_int4(packed, out, inp)
    w = torch.empty(out, inp, dtype=torch.float32)
    for g in range(scale.shape[1]):
        c = slice(g * INT4_GROUP, min(inp, (g + 1) * INT4_GROUP))
        w[:, c] = q[:, c].to(torch.float32) * scale[:, g : g + 1].to(torch.float32)
    return w


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 [out, in], scale [out, 1] -> float32 [out, in], row by row."""
    w = torch.empty(q.shape, dtype=torch.float32)
    for r in range(q.shape[0]):
        w[r] = q[r].to(torch.float32) * float(scale[r, 0])
    return w


def e2m1_value(code: int) -> float:
    """One fp4 e2m1 code (0..15) -> its value, from its bits: sign (bit 3), exponent (bits 1-2,
    bias 1), mantissa (bit 0); exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code // 8 else 1.0
    exponent, mantissa = (code // 2) % 4, code % 2
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa * 0.5) * 2.0 ** (exponent - 1)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [out, in/32, 16], scales uint8 [out, in/32] -> float32 [out, in], group by
    group: element 2j of a group is byte j's low nibble, element 2j + 1 its high one, each times
    2^(scale - 127)."""
    out, groups, half = blocks.shape
    w = torch.empty(out, groups * MXFP4_GROUP, dtype=torch.float32)
    for r in range(out):
        for g in range(groups):
            factor = 2.0 ** (int(scales[r, g]) - 127)
            for j in range(half):
                byte = int(blocks[r, g, j])
                w[r, g * MXFP4_GROUP + 2 * j] = e2m1_value(byte % 16) * factor
                w[r, g * MXFP4_GROUP + 2 * j + 1] = e2m1_value(byte // 16) * factor
    return w


def dequantize(fmt_name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reference dequantization of one weight of format ``fmt_name`` -> float32 [out, in]."""
    if fmt_name == "fp8":
        return dequantize_fp8(parts["weight"], parts["weight_scale_inv"])
    if fmt_name == "int4":
        return dequantize_int4(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"])
    if fmt_name == "int8":
        return dequantize_int8(parts["weight"], parts["weight_scale"])
    if fmt_name == "mxfp4":
        return dequantize_mxfp4(parts["blocks"], parts["scales"])
    raise ValueError(f"no reference dequantizer for format {fmt_name!r}")
