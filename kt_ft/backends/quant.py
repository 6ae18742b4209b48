"""Quantized weight formats kt-ft reads and writes: how one linear weight W [out, in] is stored.

Each format stores W as a few tensors named after the weight's key (``X.weight`` ->
``X.<name>``) and says how to get W back. The three layouts are the ones models are
distributed in, so kt-ft reads those checkpoints as they are:

* ``fp8`` (DeepSeek-V3/R1 ``quant_method: fp8``): ``weight`` float8_e4m3fn [out, in] and
  ``weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)]; W = q * s per 128x128 block
  (the name says "inv" but the stored value multiplies, as DeepSeek's own dequantizer does).
* ``int4`` (compressed-tensors ``pack-quantized``, Kimi K2 Thinking's routed experts):
  symmetric, groups of 32 along ``in``: ``weight_packed`` int32 [out, ceil(in/8)] (eight
  4-bit codes per word, code j of a word in bits 4j..4j+3, code = q + 8 with q in [-8, 7]),
  ``weight_scale`` bf16 [out, ceil(in/32)], ``weight_shape`` int64 [2] = (out, in); W = q * s.
* ``int8`` (compressed-tensors ``int-quantized``, channel strategy): ``weight`` int8 [out, in]
  and ``weight_scale`` float32 [out, 1], symmetric; W = q * s per output row.
* ``mxfp4`` (OCP microscaling FP4, ``quant_method: mxfp4``, gpt-oss's routed experts): groups of
  32 along ``in`` (``in`` a multiple of 32: the files keep no shape to cut padding off):
  ``blocks`` uint8 [out, in/32, 16], element j of a group in byte j // 2, the low nibble for even
  j (an fp4 e2m1 code: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6), and
  ``scales`` uint8 [out, in/32], an e8m0 exponent; W = value * 2^(scale - 127). gpt-oss stores
  them fused over experts under ``{experts}.gate_up_proj_blocks`` etc. (``quant/loading.py``).

The dequantizers here are vectorised (the path training takes, a chunk of experts at a time);
``reference.py`` holds plain twins written differently (loops over blocks, groups and nibbles)
that the tests compare against. All dequantizers compute q * s in float32 and round once to the
requested dtype: fp8 codes become float16 values / 256 by bit arithmetic (``e4m3_as_half``: torch's
own fp8 -> float conversion and a 256-entry table were the slow part, ~15 and ~11 ms of an
expert's [2304, 2048] weight on 2 AVX2 cores, the whole dequantization now ~8 ms), int4 bytes go
through a 256-entry table (byte -> its two codes), and the scale product writes the output dtype
directly (int4 4.1 -> 2.5 ms against converting and scaling in separate steps).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kt_ft.backends import dequant_triton, native
from kt_ft.base.log import get_logger

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


# fp4 e2m1 magnitudes of codes 0..7 (code bit 3 is the sign): the OCP MX spec's table
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _build_table(kind: str) -> torch.Tensor:
    b = torch.arange(256)
    if kind == "int4":
        return torch.stack([b % 16 - 8, b // 16 - 8], 1).float()
    if kind == "e2m1":  # byte -> (value of its low nibble, value of its high nibble)
        vals = torch.tensor(E2M1 + tuple(-v for v in E2M1))
        return torch.stack([vals[b % 16], vals[b // 16]], 1)
    # e8m0: byte -> 2^(byte - 127) (255 gives inf; the spec's NaN, not written by any encoder)
    return torch.exp2(b.double() - 127).float()


def _table(kind: str, device: torch.device) -> torch.Tensor:
    """Lookup tables, one per device: ``int4`` [256, 2] float32 (byte -> the codes of its low and
    high nibble, minus the offset 8), ``e2m1`` [256, 2] float32 (byte -> the fp4 values of its low
    and high nibble), ``e8m0`` [256] float32 (byte -> 2^(byte - 127))."""
    key = (kind, device)
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = _build_table(kind).to(device)
    return t


FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_GROUP = 32
MXFP4_GROUP = 32
E8M0_BIAS = 127


@dataclass(frozen=True)
class Stored:
    """One stored tensor of a quantized weight: its name suffix, shape and dtype (the one kt-ft
    writes; ``also``: other dtypes files of that layout use, read as well)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    also: tuple[torch.dtype, ...] = ()

    def accepts(self, dtype: torch.dtype | None) -> bool:
        return dtype == self.dtype or dtype in self.also


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class QuantFormat:
    """One storage format. Subclasses give the stored tensors, quantize and dequantize."""

    name: str = ""
    description: str = ""

    def stored(self, out: int, inp: int) -> tuple[Stored, ...]:
        """The tensors one weight [out, in] is stored as (shapes and dtypes the files must have)."""
        raise NotImplementedError

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """w [out, in] (any float dtype) -> {suffix: tensor} as ``stored`` says (on w's device, contiguous)."""
        raise NotImplementedError

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """{suffix: tensor} of one weight -> W [out, in] in ``dtype`` (computed in float32)."""
        raise NotImplementedError

    def dequantize_many(
        self, parts: dict[str, torch.Tensor], dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """{suffix: tensor [g, ...]} of g weights (stacked on dim 0) -> [g, out, in] in ``dtype``, the
        values ``dequantize`` gives each; written into ``out`` ([g, out, in], any strides) when given.

        This one loops over the g weights; formats whose arithmetic broadcasts over a leading dim
        override it with one pass over all g (what the GPU's grouped products read: a handful of
        kernels for a chunk of experts instead of a few per expert)."""
        g = next(iter(parts.values())).shape[0]
        for e in range(g):
            w = self.dequantize({k: t[e] for k, t in parts.items()}, dtype)
            if out is None:
                out = torch.empty(g, *w.shape, dtype=dtype, device=w.device)
            out[e].copy_(w)
        return out

    def quantization_config(self) -> dict:
        """The ``quantization_config`` of config.json for a checkpoint in this format."""
        raise NotImplementedError

    def shape_problem(self, out: int, inp: int) -> str | None:
        """Why a weight [out, in] cannot be stored in this format (None: it can)."""
        return None

    def nbytes(self, out: int, inp: int) -> int:
        """Bytes one weight [out, in] takes stored."""
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in self.stored(out, inp))

    def marker(self) -> str:
        """The stored tensor whose presence says a weight is in this format (not ``weight``)."""
        return next(s.name for s in self.stored(1, 1) if s.name != "weight")

    def __repr__(self) -> str:
        return f"QuantFormat({self.name})"


E4M3_HALF_SCALE = 256.0  # e4m3_as_half's values times this are the e4m3 values


@functools.lru_cache(maxsize=1)
def _native_lib():
    """``kt_ft.backends.native`` where its library is available, else None (logged once, with why)."""
    why = native.unavailable_reason()
    if why:
        get_logger(__name__).info(
            f"quantized weights are dequantized on the CPU by torch, not kt-ft's native kernels: {why}"
        )
        return None
    return native


def _native(q: torch.Tensor, dtype: torch.dtype, name: str):
    """kt-ft's C++ dequantizer ``name`` of ``kt_ft.backends.native`` (``kernels/dequant.cpp``:
    ``dequant_fp8_block``, ``dequant_int8_rows``; bitwise the torch twins here and several times
    faster: docs/quantized.md) for codes ``q`` to ``dtype``: None off the CPU, for another dtype
    than bf16 / fp32, or where the native library is not available."""
    if q.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    lib = _native_lib()
    return None if lib is None else getattr(lib, name)


def e4m3_as_half(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [...] -> float16 [...] holding each value / 256, exactly (NaN codes: NaN).

    Bit arithmetic instead of torch's fp8 conversion (scalar on CPUs: ~8x slower for an expert's
    weight on 2 AVX2 cores): e4m3's exponent field (bias 7) and mantissa placed in float16's low
    exponent bits (bias 15) and top mantissa bits give the same value times 2^-8, subnormals
    included (e4m3's become float16's). float16 holds every such value exactly, so scaling by
    256 * s in float32 and rounding once gives what converting first gives."""
    x = q.view(torch.int8).to(torch.int16)  # sign-extended: bit 15 is the sign
    mag = x & 0x7F
    bits = (mag << 7) | (x & -0x8000)
    return bits.masked_fill_(mag == 0x7F, 0x7E00).view(torch.float16)  # 0x7E00: float16 NaN


class Fp8Block(QuantFormat):
    name = "fp8"
    description = "float8 e4m3 weights, float32 scale per 128x128 block (DeepSeek-V3 `quant_method: fp8`)"

    def stored(self, out, inp):
        b = FP8_BLOCK
        return (
            Stored("weight", (out, inp), torch.float8_e4m3fn),
            Stored("weight_scale_inv", (-(-out // b), -(-inp // b)), torch.float32),
        )

    def quantize(self, w):
        out, inp = w.shape
        b = FP8_BLOCK
        wf = w.float()
        rows, cols = -(-out // b), -(-inp // b)
        padded = torch.zeros(rows * b, cols * b, device=w.device)
        padded[:out, :inp] = wf
        blocks = padded.view(rows, b, cols, b)
        # one scale per block: its largest |w| maps to e4m3's largest finite value
        scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX  # [rows, cols]
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        q = q.view(rows * b, cols * b)[:out, :inp].contiguous()
        return {"weight": q, "weight_scale_inv": scale.contiguous()}

    def dequantize(self, parts, dtype):
        q, s = parts["weight"], parts["weight_scale_inv"].float()
        out, inp = q.shape
        b = FP8_BLOCK
        native = _native(q, dtype, "dequant_fp8_block")
        if native is not None:
            return native(q, s, torch.empty(out, inp, dtype=dtype), b)
        if q.device.type == "cuda" and out % b == 0 and inp % b == 0:  # two kernels (dequantize_many)
            return self.dequantize_many({k: t[None] for k, t in parts.items()}, dtype)[0]
        vals, s = e4m3_as_half(q), s * E4M3_HALF_SCALE  # [out, in] float16: the values / 256
        w = torch.empty(out, inp, dtype=dtype, device=q.device)
        # scale broadcast over its block without a full-size scale tensor when the shape divides
        if out % b == 0 and inp % b == 0:
            view = (out // b, b, inp // b, b)
            torch.mul(vals.view(view), s[:, None, :, None], out=w.view(view))
            return w
        full = s.repeat_interleave(b, 0)[:out].repeat_interleave(b, 1)[:, :inp]
        return torch.mul(vals, full, out=w)

    def dequantize_many(self, parts, dtype, out=None):
        q, s = parts["weight"], parts["weight_scale_inv"].float()
        g, rows, inp = q.shape
        b = FP8_BLOCK
        native = _native(q, dtype, "dequant_fp8_block")
        if native is not None:  # any shape: partial blocks too
            return native(q, s, torch.empty(g, rows, inp, dtype=dtype) if out is None else out, b)
        if q.device.type == "cuda":
            if dequant_triton.available(q, dtype):  # one kernel, 3 bytes an element moved; any shape
                o = torch.empty(g, rows, inp, dtype=dtype, device=q.device) if out is None else out
                return dequant_triton.dequant_fp8_block(q, s, o)
        if rows % b or inp % b:
            return super().dequantize_many(parts, dtype, out)
        if out is None:
            out = torch.empty(g, rows, inp, dtype=dtype, device=q.device)
        view = (g, rows // b, b, inp // b, b)
        if q.device.type == "cuda":
            # the Triton kernel's twin, two kernels: the GPU converts e4m3 exactly to any wider
            # float (no table, no float32 copy); the product with the float32 scale is computed in
            # float32 and rounded once, as above
            out.copy_(q)
            out.view(view).mul_(s[:, :, None, :, None])
            return out
        torch.mul(e4m3_as_half(q).view(view), (s * E4M3_HALF_SCALE)[:, :, None, :, None], out=out.view(view))
        return out

    def quantization_config(self):
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] integers in [-8, 7] (any dtype) -> int32 [out, ceil(in/8)]: code j of a word in
    bits 4j..4j+3, code = q + 8 (compressed-tensors' ``pack_to_int32`` along the input dim)."""
    out, inp = q.shape
    codes = q.to(torch.int64) + 8  # offset encoding, 0..15
    words = -(-inp // 8)
    codes = torch.nn.functional.pad(codes, (0, words * 8 - inp), value=8).view(out, words, 8)
    shifts = torch.arange(8, dtype=torch.int64, device=q.device) * 4
    packed = (codes << shifts).sum(-1)  # < 2^32: the same bits as a signed int32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).contiguous()


class Int4Packed(QuantFormat):
    name = "int4"
    description = "int4 symmetric, bf16 scale per group of 32 inputs, packed 8 to an int32 (compressed-tensors pack-quantized)"

    def stored(self, out, inp):
        return (
            Stored("weight_packed", (out, -(-inp // 8)), torch.int32),
            # compressed-tensors writes the scale in the model's dtype and the shape as int64
            Stored("weight_scale", (out, -(-inp // INT4_GROUP)), torch.bfloat16, _FLOATS),
            Stored("weight_shape", (2,), torch.int64, (torch.int32,)),
        )

    def quantize(self, w):
        out, inp = w.shape
        g = INT4_GROUP
        groups = -(-inp // g)
        padded = torch.zeros(out, groups * g, device=w.device)
        padded[:, :inp] = w.float()
        # compressed-tensors' symmetric scale: the group's largest |w| over half the code range (15/2)
        scale = (padded.view(out, groups, g).abs().amax(-1) / 7.5).clamp_min(1e-12).to(torch.bfloat16)
        q = torch.round(padded.view(out, groups, g) / scale.float()[..., None]).clamp(-8, 7)
        return {
            "weight_packed": pack_int4(q.view(out, groups * g)[:, :inp]),
            "weight_scale": scale.contiguous(),
            "weight_shape": torch.tensor([out, inp], dtype=torch.int64, device=w.device),
        }

    def dequantize(self, parts, dtype):
        packed, s = parts["weight_packed"], parts["weight_scale"].float()
        out, inp = (int(v) for v in parts["weight_shape"])
        # the int32 words as bytes (little-endian: byte j//2 of a word holds codes j, j+1, low
        # nibble first), each byte -> its two values through the table
        codes = packed.contiguous().view(torch.uint8).reshape(-1).int()
        q = torch.index_select(_table("int4", packed.device), 0, codes).view(out, -1)[:, :inp]
        w = torch.empty(out, inp, dtype=dtype, device=packed.device)
        g = INT4_GROUP
        if inp % g == 0:
            torch.mul(q.view(out, inp // g, g), s[..., None], out=w.view(out, inp // g, g))
            return w
        return torch.mul(q, s.repeat_interleave(g, 1)[:, :inp], out=w)

    def quantization_config(self):
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": INT4_GROUP,
                        "dynamic": False,
                        "actorder": None,
                        "observer": "minmax",
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
        }


class Int8Channel(QuantFormat):
    name = "int8"
    description = "int8 symmetric, float32 scale per output channel (compressed-tensors int-quantized)"

    def stored(self, out, inp):
        return (
            Stored("weight", (out, inp), torch.int8),
            Stored("weight_scale", (out, 1), torch.float32, _FLOATS),
        )

    def quantize(self, w):
        wf = w.float()
        scale = (wf.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
        q = torch.round(wf / scale).clamp(-127, 127).to(torch.int8)
        return {"weight": q.contiguous(), "weight_scale": scale.contiguous()}

    def dequantize(self, parts, dtype):
        return self.dequantize_many({k: t[None] for k, t in parts.items()}, dtype)[0]

    def dequantize_many(self, parts, dtype, out=None):
        # [g, out, in] int8 x [g, out, 1] float32: computed in float32, written to ``dtype`` (one
        # rounding), by the native kernel on the CPU (same bits) or one torch product
        q, s = parts["weight"], parts["weight_scale"].float()
        if out is None:
            out = torch.empty(q.shape, dtype=dtype, device=q.device)
        native = _native(q, dtype, "dequant_int8_rows")
        if native is not None:
            return native(q, s, out)
        return torch.mul(q, s, out=out)

    def quantization_config(self):
        return {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "channel",
                        "group_size": None,
                        "dynamic": False,
                        "observer": "minmax",
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
        }


class Mxfp4(QuantFormat):
    name = "mxfp4"
    description = (
        "fp4 e2m1 weights, e8m0 power-of-two scale per group of 32 inputs (gpt-oss `quant_method: mxfp4`)"
    )

    def stored(self, out, inp):
        groups = -(-inp // MXFP4_GROUP)
        return (
            Stored("blocks", (out, groups, MXFP4_GROUP // 2), torch.uint8),
            Stored("scales", (out, groups), torch.uint8),
        )

    def shape_problem(self, out, inp):
        if inp % MXFP4_GROUP:
            return f"mxfp4 stores whole groups of {MXFP4_GROUP} inputs and no shape; in={inp} is not a multiple of {MXFP4_GROUP}"
        return None

    def quantize(self, w):
        out, inp = w.shape
        problem = self.shape_problem(out, inp)
        if problem:
            raise ValueError(f"weight {list(w.shape)}: {problem}")
        g = MXFP4_GROUP
        wf = w.float().view(out, inp // g, g)
        amax = wf.abs().amax(-1)
        # the smallest power of two that brings the group's largest |w| within e2m1's 6: no clipping
        exp = torch.ceil(torch.log2(amax / E2M1[-1])).nan_to_num(0, posinf=0, neginf=-E8M0_BIAS)
        exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
        q = wf / torch.exp2(exp)[..., None]
        mags = torch.tensor(E2M1, device=w.device)
        # nearest magnitude: count the midpoints between table entries that |q| exceeds
        idx = torch.bucketize(q.abs().clamp(max=E2M1[-1]).contiguous(), (mags[1:] + mags[:-1]) / 2)
        codes = (idx + 8 * q.signbit()).to(torch.uint8).view(out, inp // g, g // 2, 2)
        return {
            "blocks": (codes[..., 0] | (codes[..., 1] << 4)).contiguous(),
            "scales": (exp + E8M0_BIAS).to(torch.uint8).contiguous(),
        }

    def dequantize(self, parts, dtype):
        blocks, scales = parts["blocks"], parts["scales"]
        out, groups, half = blocks.shape
        dev = blocks.device
        # each byte -> its two values (low nibble first) through one table, then the group's
        # power of two: two passes over the weight, the product written in ``dtype``
        vals = torch.index_select(_table("e2m1", dev), 0, blocks.contiguous().view(-1).int())
        s = torch.index_select(_table("e8m0", dev), 0, scales.contiguous().view(-1).int())
        w = torch.empty(out, groups * half * 2, dtype=dtype, device=dev)
        view = (out, groups, half * 2)
        torch.mul(vals.view(view), s.view(out, groups, 1), out=w.view(view))
        return w

    def quantization_config(self):
        # the keys gpt-oss's config.json has; the modules listed are those it stores in bf16
        return {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (Int8Channel(), Fp8Block(), Int4Packed(), Mxfp4())}

# safetensors header dtype names of the tensors the formats store
ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}
