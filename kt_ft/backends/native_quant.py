"""A ``QuantizedExperts`` described for kt-ft's C++ GEMMs over quantized experts.

``quant_parts(w)`` gives the ``native.QuantPart`` array ``native.grouped_quant`` reads: per part
(gate rows, up rows; or all rows), the stored codes and scales of every expert with their strides,
the format's kind and scale dtype. Nothing is copied: the array points into the stored tensors
(the caller keeps ``w`` alive for the call). ``unsupported(w)`` says why a weight cannot be read
that way (the torch backend's path then computes it).

The four formats, as ``kt_ft.backends.quant`` stores them (per expert, W [rows, cols]):

* ``fp8``: ``weight`` float8_e4m3fn [rows, cols], ``weight_scale_inv`` float32 [rows/128, cols/128];
* ``int8``: ``weight`` int8 [rows, cols], ``weight_scale`` float [rows, 1];
* ``int4``: ``weight_packed`` int32 [rows, cols/8] (read as its little-endian bytes: column c in
  byte c/2), ``weight_scale`` bf16/fp16/float32 [rows, cols/32];
* ``mxfp4``: ``blocks`` uint8 [rows, cols/32, 16] (column c in byte c/2 of the row), ``scales``
  uint8 e8m0 [rows, cols/32].
"""

from __future__ import annotations

import ctypes

import torch

from kt_ft.backends import native
from kt_ft.backends.quant import FP8_BLOCK, INT4_GROUP, MXFP4_GROUP
from kt_ft.backends.quant_weights import QuantizedExperts

# per format: (codes key, scale key, rows a scale row covers, columns a scale covers (0: the row))
_LAYOUT = {
    "fp8": ("weight", "weight_scale_inv", FP8_BLOCK, FP8_BLOCK),
    "int8": ("weight", "weight_scale", 1, 0),
    "int4": ("weight_packed", "weight_scale", 1, INT4_GROUP),
    "mxfp4": ("blocks", "scales", 1, MXFP4_GROUP),
}


def unsupported(w: QuantizedExperts) -> str | None:
    """Why the native GEMMs cannot read ``w`` in place (None: they can)."""
    name = w.fmt.name
    if name not in _LAYOUT:
        return f"format {name!r} has no native decoder (native decodes {', '.join(_LAYOUT)})"
    if w.transposed:
        return f"its {name} weights are stored transposed to the product's layout (gpt-oss)"
    if w.device.type != "cpu":
        return f"its weights are on {w.device}"
    codes_key, scale_key, _, _ = _LAYOUT[name]
    for p in w.parts:
        codes, scale = p[codes_key], p[scale_key]
        if codes.stride(-1) != 1 or (codes.dim() == 4 and codes.stride(2) != codes.shape[3]):
            return f"its {codes_key} rows are not contiguous (strides {codes.stride()})"
        if scale.dtype not in native.SCALE_TYPES or (scale.shape[-1] > 1 and scale.stride(-1) != 1):
            return f"its {scale_key} is {scale.dtype} with strides {scale.stride()}"
    return None


def quant_parts(w: QuantizedExperts) -> ctypes.Array:
    """The ``native.QuantPart`` array of ``w`` (``unsupported(w)`` must be None)."""
    why = unsupported(w)
    if why is not None:
        raise ValueError(f"native quantized GEMM: {why}")
    name = w.fmt.name
    codes_key, scale_key, block_rows, group = _LAYOUT[name]
    arr = (native.QuantPart * len(w.parts))()
    for i, (p, rows) in enumerate(zip(w.parts, w.part_rows, strict=True)):
        codes, scale = p[codes_key], p[scale_key]
        item = codes.element_size()  # int4's int32 words: strides in bytes
        arr[i] = native.QuantPart(
            kind=native.QUANT_KINDS[name],
            scale_type=native.SCALE_TYPES[scale.dtype],
            rows=rows,
            block_rows=block_rows,
            group=group or w.cols,
            codes=codes.data_ptr(),
            code_estride=codes.stride(0) * item,
            code_ld=codes.stride(1) * item,
            scale=scale.data_ptr(),
            scale_estride=scale.stride(0),
            scale_ld=scale.stride(1),
        )
    return arr


def grouped(trans_w: bool, a: torch.Tensor, w: QuantizedExperts, out: torch.Tensor, plan: torch.Tensor, **kw):
    """``native.grouped_quant`` over ``w`` for the groups of ``plan`` (int64 [4, G]: expert, first
    row, rows, padding rows); ``kw``: beta, threads, isa. Returns out."""
    return native.grouped_quant(
        trans_w, a, quant_parts(w), tuple(w.shape), out, plan[0], plan[1], plan[2], plan[3], **kw
    )
