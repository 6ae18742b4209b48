"""kt-ft's own C++ CPU GEMMs (``kernels/expert_gemm.cpp``) through ctypes: bf16 weights read in
place, fp32 activations and outputs (the ``avx512bf16`` and ``amx`` paths round the activations
to bf16 before multiplying: ``ROUNDS_TO_BF16``).

* ``gemm_bf16_nt(x, w, out, beta)``: out[M, N] = beta * out + x[M, K] @ w[N, K]^T (forward);
* ``gemm_bf16_nn(dy, w, out, beta)``: out[M, K] = beta * out + dy[M, N] @ w[N, K] (backward);
* ``grouped_bf16(...)``: one product per expert over row ranges of shared buffers, one call;
* ``grouped_quant(...)``: the same over expert weights kept quantized (FP8 blocks, INT8 rows, INT4
  and MXFP4 groups), decoded to bf16 a work item's slab at a time (``kernels/quant_decode.h``);
* ``silu_mul_forward`` / ``silu_mul_backward``: the experts' activation and its backward, each one
  pass over the rows (``kernels/expert_act.cpp``);
* ``gather_rows`` / ``combine_rows``: token order -> expert order (widening bf16) and back (the
  routing-weighted sum over a token's slots), one pass each (``kernels/expert_rows.cpp``);
* ``dequant_fp8_block(q, scale, out)``, ``dequant_int8_rows(q, scale, out)``: block-scaled FP8 /
  per-channel INT8 expert weights to bf16 / fp32 (``kernels/dequant.cpp``; ``kt_ft.backends.quant``
  calls them for weights kept quantized).

The library is looked for, in order: the one built at install (``_native/`` beside this file;
in a source tree only if built from the current sources), then the per-user cache
(``KT_FT_CACHE_DIR``/native/<source hash>/), which is compiled on first use when
``KT_FT_NATIVE_BUILD`` allows. ``python -m kt_ft.backends.native --build`` builds it now.
``unavailable_reason()`` says why it cannot be used (with the compiler's output).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

from kt_ft.backends import native_build
from kt_ft.base.settings import enabled, get

# KT_FT_NATIVE_ISA's choices and the library's codes; each path's CPU needs include the previous
# one's: avx2 (AVX2+FMA), avx512 (AVX-512F), avx512bf16 (AVX512-BF16/BW/VL), amx (AMX-BF16 + the
# OS's tile permission)
ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4, "amx": 5}
_ISA_NAMES = {code: name for name, code in ISAS.items()}
# paths that round the fp32 activations to bf16 (to nearest even) before their products
ROUNDS_TO_BF16 = ("avx512bf16", "amx")
PACKAGED_DIR = Path(__file__).resolve().parent / "_native"
ABI_VERSION = 3  # kernels/expert_gemm.cpp's ktft_abi_version: the functions and structs bound here
_i64, _int, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ptr = ctypes.c_void_p


def cache_dir() -> Path:
    root = get("KT_FT_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "kt-ft") / "native"


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.ktft_best_isa.restype = _int
    lib.ktft_limit_isa.restype = None
    lib.ktft_limit_isa.argtypes = [_int]
    lib.ktft_abi_version.restype = _int
    lib.ktft_gemm_bf16.restype = _int
    lib.ktft_gemm_bf16.argtypes = [
        _int,
        _i64,
        _i64,
        _i64,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _f32,
        _int,
        _int,
    ]
    lib.ktft_grouped_gemm_bf16.restype = _int
    lib.ktft_grouped_gemm_bf16.argtypes = [
        *(_int, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64),
        *(_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _f32, _int, _int),
    ]
    lib.ktft_grouped_gemm_quant.restype = _int
    lib.ktft_grouped_gemm_quant.argtypes = [
        *(_int, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64),
        *(_ptr, _i64, _ptr, _int, _ptr, _i64, _f32, _int, _int),
    ]
    lib.ktft_silu_mul_fwd.restype = _int
    lib.ktft_silu_mul_fwd.argtypes = [_i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _int]
    lib.ktft_silu_mul_bwd.restype = _int
    lib.ktft_silu_mul_bwd.argtypes = [
        *(_i64, _i64, _ptr, _int, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _int, _int)
    ]
    lib.ktft_gather_rows.restype = _int
    lib.ktft_gather_rows.argtypes = [_i64, _i64, _ptr, _int, _i64, _ptr, _ptr, _i64, _int, _int]
    lib.ktft_combine_rows.restype = _int
    lib.ktft_combine_rows.argtypes = [_i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _int, _int]
    lib.ktft_dequant_fp8_block.restype = _int
    lib.ktft_dequant_fp8_block.argtypes = [
        *(_i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _int, _int)
    ]
    lib.ktft_dequant_int8_rows.restype = _int
    lib.ktft_dequant_int8_rows.argtypes = [
        *(_i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _int, _int)
    ]
    return lib


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not). Built at most once a process."""
    current = native_build.source_hash()
    packaged = PACKAGED_DIR / native_build.LIB_NAME
    hash_file = PACKAGED_DIR / native_build.HASH_NAME
    candidates = []
    if packaged.exists() and (current is None or (hash_file.exists() and hash_file.read_text() == current)):
        candidates.append(packaged)
    if current is not None:
        candidates.append(cache_dir() / current / native_build.LIB_NAME)
    if not candidates:
        return None, f"no built library at {packaged} and no sources to build it from"
    lib_path = next((p for p in candidates if p.exists()), None)
    if lib_path is None:
        if not enabled("KT_FT_NATIVE_BUILD"):
            return (
                None,
                f"not built (KT_FT_NATIVE_BUILD=0; build with `{sys.executable} -m kt_ft.backends.native --build`)",
            )
        lib_path, why = native_build.build(candidates[-1].parent)
        if lib_path is None:
            return None, f"could not build the native CPU kernels: {why}"
    try:
        lib = _bind(ctypes.CDLL(str(lib_path)))
    except (OSError, AttributeError) as e:
        return None, f"could not load {lib_path}: {e}"
    if lib.ktft_abi_version() != ABI_VERSION:
        return (
            None,
            f"{lib_path} has ABI {lib.ktft_abi_version()}, this kt-ft binds ABI {ABI_VERSION}: rebuild it",
        )
    return lib, ""


def unavailable_reason() -> str | None:
    return _load()[1] or None


def library() -> ctypes.CDLL:
    lib, why = _load()
    if lib is None:
        raise RuntimeError(why)
    return lib


def best_isa() -> str:
    """The fastest path the library runs on this CPU and OS: ``amx``, ``avx512bf16``, ``avx512``,
    ``avx2`` or ``scalar`` (CPUID and XGETBV, read by the library)."""
    code = library().ktft_best_isa()
    return _ISA_NAMES.get(code, str(code))


def active_isa() -> str:
    """The path the GEMMs take now: ``KT_FT_NATIVE_ISA`` where it names one (checked as a call
    would), else ``best_isa()``."""
    code = _isa(None)
    return best_isa() if code == 0 else _ISA_NAMES[code]


def runnable_isas() -> list[str]:
    """Every path this CPU runs, slowest first (``scalar`` .. ``best_isa()``)."""
    best = ISAS[best_isa()]
    return [name for name, code in ISAS.items() if 0 < code <= best]


def _isa(isa: str | None) -> int:
    isa = isa or get("KT_FT_NATIVE_ISA")
    if isa not in ISAS:
        raise ValueError(f"KT_FT_NATIVE_ISA={isa!r} is not a native ISA; valid: {', '.join(ISAS)}")
    if isa != "auto" and ISAS[isa] > ISAS[best_isa()]:  # never let the library try it
        raise RuntimeError(
            f"KT_FT_NATIVE_ISA={isa!r}: this CPU (or its OS) does not run it; it runs "
            f"{', '.join(runnable_isas())} (valid choices: {', '.join(ISAS)})"
        )
    return ISAS[isa]


def _check_2d(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"native GEMM: {name} must be {dtype}, got {t.dtype}")
    if t.device.type != "cpu" or t.dim() != 2:
        raise ValueError(f"native GEMM: {name} must be a 2-D CPU tensor, got {t.dim()}-D on {t.device}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"native GEMM: {name} rows must be contiguous (stride(1) == 1), got {t.stride()}")


def _threads(threads: int | None) -> int:
    return max(1, threads or torch.get_num_threads())


def _call_status(code: int, isa: str | None) -> None:
    if code < 0:  # the library's own check (the same as _isa's): kept as a second guard
        raise RuntimeError(
            f"native GEMM refused (code {code}): KT_FT_NATIVE_ISA={isa or get('KT_FT_NATIVE_ISA')!r} "
            f"not run by this CPU (or its OS); it runs {', '.join(runnable_isas())}"
        )


def gemm_bf16_nt(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    beta: float = 0.0,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """out[M, N] = beta * out + x[M, K] @ w[N, K]^T; x, out fp32, w bf16, rows contiguous (any row
    stride). beta 0 never reads out. Returns out."""
    return _gemm(1, x, w, out, beta, threads, isa)


def gemm_bf16_nn(
    dy: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    beta: float = 0.0,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """out[M, K] = beta * out + dy[M, N] @ w[N, K]; dy, out fp32, w bf16. Returns out."""
    return _gemm(0, dy, w, out, beta, threads, isa)


def _gemm(trans_w, a, w, out, beta, threads, isa):
    for name, t, dt in (
        ("activations", a, torch.float32),
        ("w", w, torch.bfloat16),
        ("out", out, torch.float32),
    ):
        _check_2d(name, t, dt)
    m, k_in = a.shape
    n_out, k_w = (w.shape[0], w.shape[1]) if trans_w else (w.shape[1], w.shape[0])
    if k_w != k_in or tuple(out.shape) != (m, n_out):
        kind = "x[M, K] @ w[N, K]^T" if trans_w else "dy[M, N] @ w[N, K]"
        raise ValueError(
            f"native GEMM {kind}: shapes {tuple(a.shape)}, {tuple(w.shape)} -> out {tuple(out.shape)}"
        )
    code = library().ktft_gemm_bf16(
        trans_w, m, n_out, k_in, a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0),
        out.data_ptr(), out.stride(0), beta, _threads(threads), _isa(isa),
    )  # fmt: skip
    _call_status(code, isa)
    return out


def grouped_bf16(
    trans_w: bool,
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    experts: torch.Tensor,
    row0: torch.Tensor,
    rows: torch.Tensor,
    pad: torch.Tensor | None = None,
    beta: float = 0.0,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """For each i: out[r:r+n] = beta * out[r:r+n] + a[r:r+n] @ op(w[e]) with (e, r, n) = (experts[i],
    row0[i], rows[i]); op(W) = W^T when ``trans_w`` (w [E, N, K], a [*, K], out [*, N]) else W
    (w [E, N, K], a [*, N], out [*, K]). a, out fp32; w bf16 with contiguous experts' rows;
    experts/row0/rows int64 [G]; ``pad`` int64 [G] or None: then out[r+n : r+n+pad[i]] = 0 (padding
    rows); other rows of out are left alone. Returns out."""
    if w.dtype != torch.bfloat16 or w.dim() != 3 or w.stride(2) != 1:
        raise ValueError(
            f"native grouped GEMM: w must be bf16 [E, N, K] with contiguous rows, got {w.dtype} {w.stride()}"
        )
    n_in, n_out = _check_groups(trans_w, a, tuple(w.shape), out, experts, row0, rows, pad)
    code = library().ktft_grouped_gemm_bf16(
        int(trans_w), experts.numel(), experts.data_ptr(), row0.data_ptr(), rows.data_ptr(),
        None if pad is None else pad.data_ptr(), n_out, n_in,
        a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0), w.stride(1),
        out.data_ptr(), out.stride(0), beta, _threads(threads), _isa(isa),
    )  # fmt: skip
    _call_status(code, isa)
    return out


def _check_groups(trans_w, a, w_shape, out, experts, row0, rows, pad) -> tuple[int, int]:
    """The grouped products' checks (a wrong index would read or write outside the buffers);
    returns (inputs, outputs) of each product."""
    _check_2d("activations", a, torch.float32)
    _check_2d("out", out, torch.float32)
    n_w, k_w = w_shape[1:]
    k_in, n_out = (k_w, n_w) if trans_w else (n_w, k_w)
    if a.shape[1] != k_in or out.shape[1] != n_out:
        raise ValueError(
            f"native grouped GEMM: a {tuple(a.shape)}, w {tuple(w_shape)}, out {tuple(out.shape)}"
        )
    for name, t in (("experts", experts), ("row0", row0), ("rows", rows), ("pad", pad)):
        if t is None:
            continue
        if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != experts.shape:
            raise ValueError(f"native grouped GEMM: {name} must be contiguous int64 like experts")
    if rows.numel():
        if int(experts.min()) < 0 or int(experts.max()) >= w_shape[0]:
            raise ValueError("native grouped GEMM: expert index out of range")
        end = row0 + rows + (0 if pad is None else pad)
        if int(row0.min()) < 0 or int(rows.min()) < 0 or int(end.max()) > min(a.shape[0], out.shape[0]):
            raise ValueError("native grouped GEMM: row range past the buffers")
    return k_in, n_out


class QuantPart(ctypes.Structure):
    """One part of an expert weight kept quantized, every expert (``kernels/quant_decode.h``
    ``QuantPart``: same fields, same order). Byte strides for the codes, element strides for the
    scales."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("scale_type", ctypes.c_int32),
        ("rows", _i64),
        ("block_rows", _i64),
        ("group", _i64),
        ("codes", _ptr),
        ("code_estride", _i64),
        ("code_ld", _i64),
        ("scale", _ptr),
        ("scale_estride", _i64),
        ("scale_ld", _i64),
    ]


QUANT_KINDS = {"fp8": 0, "int8": 1, "int4": 2, "mxfp4": 3}  # quant_decode.h QuantKind
SCALE_TYPES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.uint8: 3,
}  # ScaleType (uint8: e8m0)


def grouped_quant(
    trans_w: bool,
    a: torch.Tensor,
    parts: ctypes.Array,
    w_shape: tuple[int, int, int],
    out: torch.Tensor,
    experts: torch.Tensor,
    row0: torch.Tensor,
    rows: torch.Tensor,
    pad: torch.Tensor | None = None,
    beta: float = 0.0,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """``grouped_bf16`` over a weight [E, N, K] kept quantized, described by ``parts`` (an array of
    ``QuantPart``, rows in order: ``native_quant.quant_parts`` builds it from a
    ``QuantizedExperts``; the caller keeps the tensors it points into alive). Each work item
    decodes the part of W it reads to bf16 (at most 128 x K a thread), so the result is
    ``grouped_bf16``'s over the weight dequantized to bf16, bit for bit. Returns out."""
    n_in, n_out = _check_groups(trans_w, a, w_shape, out, experts, row0, rows, pad)
    code = library().ktft_grouped_gemm_quant(
        int(trans_w), experts.numel(), experts.data_ptr(), row0.data_ptr(), rows.data_ptr(),
        None if pad is None else pad.data_ptr(), n_out, n_in, a.data_ptr(), a.stride(0),
        ctypes.addressof(parts), len(parts), out.data_ptr(), out.stride(0), beta, _threads(threads), _isa(isa),
    )  # fmt: skip
    if code == -3:
        raise ValueError(f"native quantized GEMM: the parts' rows do not add up to w's {tuple(w_shape)}")
    _call_status(code, isa)
    return out


def _check_rows(what: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or t.device.type != "cpu":
        raise ValueError(
            f"native {what}: {name} must be {dtype} {shape} on the CPU, got {t.dtype} {tuple(t.shape)} on {t.device}"
        )
    if len(shape) and shape[-1] > 1 and t.stride(-1) != 1:  # rows (or a 1-D tensor) contiguous
        raise ValueError(f"native {what}: {name} must have contiguous rows, got strides {t.stride()}")


def silu_mul_forward(
    gu: torch.Tensor,
    h: torch.Tensor,
    keep: torch.Tensor | None = None,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """h = silu(gu[:, :I]) * gu[:, I:] (``kernels/expert_act.cpp``, one pass). gu fp32 [N, 2I], h fp32
    [N, I]; ``keep`` bf16 [N, 2I] or None: also gets gu rounded to bf16 (nearest even). Rows
    contiguous (any row stride). Returns h."""
    n, two_i = gu.shape
    _check_rows("silu_mul_forward", "gu", gu, torch.float32, (n, two_i))
    _check_rows("silu_mul_forward", "h", h, torch.float32, (n, two_i // 2))
    if keep is not None:
        _check_rows("silu_mul_forward", "keep", keep, torch.bfloat16, (n, two_i))
    code = library().ktft_silu_mul_fwd(
        n, two_i // 2, gu.data_ptr(), gu.stride(0), h.data_ptr(), h.stride(0),
        None if keep is None else keep.data_ptr(), 0 if keep is None else keep.stride(0),
        _threads(threads), _isa(isa),
    )  # fmt: skip
    _call_status(code, isa)
    return h


def silu_mul_backward(
    gu: torch.Tensor,
    q: torch.Tensor,
    w: torch.Tensor,
    h: torch.Tensor,
    dgu: torch.Tensor,
    grad_w: torch.Tensor,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """The experts' activation backward in one pass (``kernels/expert_act.cpp``). gu [N, 2I] fp32 or
    bf16 (g | u), q fp32 [N, I] (the gradient of h per unit routing weight), w fp32 [N] (each
    row's routing weight) -> h = silu(g) u fp32 [N, I], dgu fp32 [N, 2I] (the gradients of g and u
    for dh = w q) and grad_w fp32 [N] (the row sums of h q, fp32). Returns grad_w."""
    n, two_i = gu.shape
    what = "silu_mul_backward"
    if gu.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"native {what}: gu must be float32 or bfloat16, got {gu.dtype}")
    _check_rows(what, "gu", gu, gu.dtype, (n, two_i))
    _check_rows(what, "q", q, torch.float32, (n, two_i // 2))
    _check_rows(what, "w", w, torch.float32, (n,))
    _check_rows(what, "h", h, torch.float32, (n, two_i // 2))
    _check_rows(what, "dgu", dgu, torch.float32, (n, two_i))
    _check_rows(what, "grad_w", grad_w, torch.float32, (n,))
    code = library().ktft_silu_mul_bwd(
        n, two_i // 2, gu.data_ptr(), int(gu.dtype == torch.bfloat16), gu.stride(0), q.data_ptr(), q.stride(0),
        w.data_ptr(), h.data_ptr(), h.stride(0), dgu.data_ptr(), dgu.stride(0), grad_w.data_ptr(),
        _threads(threads), _isa(isa),
    )  # fmt: skip
    _call_status(code, isa)
    return grad_w


def _check_index(what: str, idx: torch.Tensor, n: int, bound: int) -> None:
    if idx.dtype != torch.int64 or idx.dim() != 1 or idx.numel() != n or not idx.is_contiguous():
        raise ValueError(
            f"native {what}: the index must be contiguous int64 [{n}], got {idx.dtype} {tuple(idx.shape)}"
        )
    if n and (int(idx.min()) < 0 or int(idx.max()) >= bound):  # a wrong index would read outside src
        raise ValueError(f"native {what}: an index is outside 0..{bound - 1}")


def gather_rows(
    src: torch.Tensor,
    idx: torch.Tensor,
    out: torch.Tensor,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """out[r] = src[idx[r]] widened to fp32 (``kernels/expert_rows.cpp``, one pass): src bf16 or fp32
    [T, C], idx int64 [N], out fp32 [N, C]; rows contiguous. Returns out."""
    what = "gather_rows"
    if src.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"native {what}: src must be float32 or bfloat16, got {src.dtype}")
    if src.dim() != 2:
        raise ValueError(f"native {what}: src must be [T, C], got {tuple(src.shape)}")
    _check_rows(what, "src", src, src.dtype, tuple(src.shape))
    _check_rows(what, "out", out, torch.float32, (idx.numel(), src.shape[1]))
    _check_index(what, idx, idx.numel(), src.shape[0])
    code = library().ktft_gather_rows(
        idx.numel(), src.shape[1], src.data_ptr(), int(src.dtype == torch.bfloat16), src.stride(0), idx.data_ptr(),
        out.data_ptr(), out.stride(0), _threads(threads), _isa(isa),
    )  # fmt: skip
    _call_status(code, isa)
    return out


def combine_rows(
    src: torch.Tensor,
    inv: torch.Tensor,
    weights: torch.Tensor | None,
    out: torch.Tensor,
    threads: int | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * src[inv[t k + j]] (``kernels/expert_rows.cpp``, one pass, fp32
    sums in slot order): src fp32 [N, C], inv int64 [T k], weights fp32 [T, k] or None (all 1),
    out fp32 [T, C]. Returns out."""
    what = "combine_rows"
    t, cols = out.shape
    k = inv.numel() // max(t, 1)
    _check_rows(what, "src", src, torch.float32, (src.shape[0], cols))
    _check_rows(what, "out", out, torch.float32, (t, cols))
    _check_index(what, inv, t * k, src.shape[0])
    if weights is not None:
        _check_rows(what, "weights", weights, torch.float32, (t, k))
        if not weights.is_contiguous():
            raise ValueError(f"native {what}: weights must be contiguous, got strides {weights.stride()}")
    code = library().ktft_combine_rows(
        t, k, cols, src.data_ptr(), src.stride(0), inv.data_ptr(), None if weights is None else weights.data_ptr(),
        out.data_ptr(), out.stride(0), _threads(threads), _isa(isa),
    )  # fmt: skip
    _call_status(code, isa)
    return out


def _checked_dequant(what: str, q, q_dtype, scale, out, scale_shape) -> tuple[int, int, int]:
    """(G, R, C) of a dequantizer's q [G, R, C] after checking the three tensors: q of ``q_dtype``,
    scale fp32 shaped ``scale_shape(G, R, C)``, out bf16 / fp32 shaped like q; all on the CPU with
    contiguous rows (any row and expert strides). Raises naming ``what`` and the shapes."""
    if q.dtype != q_dtype or scale.dtype != torch.float32 or out.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(
            f"native {what} dequantize: q, scale, out dtypes {q.dtype}, {scale.dtype}, {out.dtype}"
        )
    if q.dim() != 3:
        raise ValueError(f"native {what} dequantize: q must be [G, R, C] or [R, C], got {tuple(q.shape)}")
    g, r, c = q.shape
    want = scale_shape(g, r, c)
    if tuple(scale.shape) != want or tuple(out.shape) != (g, r, c):
        raise ValueError(
            f"native {what} dequantize: q {tuple(q.shape)}, scale {tuple(scale.shape)} (want {want}), "
            f"out {tuple(out.shape)}"
        )
    if any(t.device.type != "cpu" or (t.shape[2] > 1 and t.stride(2) != 1) for t in (q, scale, out)):
        raise ValueError(f"native {what} dequantize: CPU tensors with contiguous rows")
    return g, r, c


def dequant_fp8_block(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, block: int, threads: int | None = None
) -> torch.Tensor:
    """out[e] = value(q[e]) * scale[e] per ``block`` x ``block`` tile, computed in fp32 and rounded
    once to out's dtype. q float8_e4m3fn [G, R, C] (or [R, C]), scale fp32 [G, ceil(R/block),
    ceil(C/block)], out bf16 or fp32 shaped like q; rows contiguous in all three (any row and
    expert strides). Returns out."""
    if q.dim() == 2:
        dequant_fp8_block(q[None], scale[None], out[None], block, threads)
        return out
    g, r, c = _checked_dequant(
        "fp8", q, torch.float8_e4m3fn, scale, out, lambda g, r, c: (g, -(-r // block), -(-c // block))
    )
    library().ktft_dequant_fp8_block(
        g, r, c, block, q.data_ptr(), q.stride(1), q.stride(0), scale.data_ptr(), scale.stride(1),
        scale.stride(0), out.data_ptr(), out.stride(1), out.stride(0), int(out.dtype == torch.float32),
        _threads(threads),
    )  # fmt: skip
    return out


def dequant_int8_rows(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, threads: int | None = None
) -> torch.Tensor:
    """out[e] = q[e] * scale[e] (one scale per row), computed in fp32 and rounded once to out's
    dtype. q int8 [G, R, C] (or [R, C]), scale fp32 [G, R, 1], out bf16 or fp32 shaped like q;
    rows contiguous in q and out (any row and expert strides). Returns out."""
    if q.dim() == 2:
        dequant_int8_rows(q[None], scale[None], out[None], threads)
        return out
    g, r, c = _checked_dequant("int8", q, torch.int8, scale, out, lambda g, r, c: (g, r, 1))
    library().ktft_dequant_int8_rows(
        g, r, c, q.data_ptr(), q.stride(1), q.stride(0), scale.data_ptr(), scale.stride(1), scale.stride(0),
        out.data_ptr(), out.stride(1), out.stride(0), int(out.dtype == torch.float32), _threads(threads),
    )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kt_ft.backends.native --build``: compile into the cache now and report."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kt_ft.backends.native", description=main.__doc__)
    ap.add_argument("--build", action="store_true", help="(re)build the library into the cache dir")
    args = ap.parse_args(argv)
    if args.build:
        digest = native_build.source_hash()
        if digest is None:
            print(f"no sources at {native_build.SOURCE_DIR}")
            return 1
        lib, why = native_build.build(cache_dir() / digest)
        print(lib or why)
        if lib is None:
            return 1
        _load.cache_clear()
    why = unavailable_reason()
    print(f"native CPU kernels: {'unavailable: ' + why if why else 'ok, best ISA ' + best_isa()}")
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main())
