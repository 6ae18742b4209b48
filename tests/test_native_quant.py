"""kt-ft's C++ GEMMs over expert weights kept quantized (``native.grouped_quant``: each work item
decodes the rows or columns of W it reads, ``kernels/quant_decode.h``) and the ``native`` backend
on a quantized base.

Reference: the bf16 GEMM of the same path (``native.grouped_bf16``) over the weight dequantized
by kt-ft's torch dequantizers (``QuantFormat.dequantize(parts, bf16)``, themselves checked against
plain loops in test_quant.py / test_mxfp4.py). Both round value * scale once in float32 to bf16 and
then run the same blocking and sums, so the tolerance is zero: bitwise equal, on every path this CPU
runs (scalar decodes with plain loops, the others 8 columns a step with AVX2 + F16C), NT and NN,
fresh random weights whose shapes end in partial blocks and groups (FP8 rows and columns not a
multiple of 128, INT4 columns not of 32 or 8), two parts (gate and up) of different codes. The seed
is printed.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import CASES, assert_close, run_backend
from helpers.moe_inputs import make_problem

from kt_ft.backends import native as nt
from kt_ft.backends import native_quant
from kt_ft.backends.base import ExpertWeights
from kt_ft.backends.quant import FORMATS
from kt_ft.backends.quant_weights import QuantizedExperts
from kt_ft.backends.registry import select_backend

PATHS = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]
# (rows of each of the two parts, cols): partial 128-blocks and 32-groups; mxfp4 needs cols % 32 == 0
SHAPES = {"fp8": (150, 300), "int8": (37, 129), "int4": (70, 300), "mxfp4": (70, 320)}


@pytest.fixture(scope="module", autouse=True)
def library():
    why = nt.unavailable_reason()
    if why is not None:
        pytest.skip(f"native CPU kernels cannot be built here: {why}")


def need(isa: str) -> None:
    if isa not in nt.runnable_isas():
        pytest.skip(f"this CPU runs {', '.join(nt.runnable_isas())}: no {isa} path here")


def quantized(fmt_name: str, experts: int, part_rows: int, cols: int, g: torch.Generator, scale_dtype=None):
    """Random experts [experts, 2 * part_rows, cols] stored in ``fmt_name``, two parts."""
    dense = torch.randn(experts, 2 * part_rows, cols, generator=g) * 0.02
    w = QuantizedExperts.from_dense(FORMATS[fmt_name], dense.bfloat16(), parts=2)
    if scale_dtype is not None:
        for part in w.parts:
            part["weight_scale"] = part["weight_scale"].to(scale_dtype)
    return w


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_grouped_quant_is_the_bf16_gemm_of_the_dequantized_weight(fmt, trans_w, isa, rng):
    need(isa)
    print(f"seed {rng.initial_seed()}")
    part_rows, cols = SHAPES[fmt]
    w = quantized(fmt, 4, part_rows, cols, rng)
    dense = w.dequantize_all(torch.bfloat16).contiguous()
    groups = [(3, 0, 7, 2), (0, 9, 1, 0), (2, 10, 0, 3), (1, 13, 40, 1)]  # (expert, row0, rows, pad)
    total = 60  # rows 54.. belong to no range
    n, k = dense.shape[1:]
    a = torch.randn(total, k if trans_w else n, generator=rng)
    plan = torch.tensor(groups, dtype=torch.int64).t().contiguous()
    want = torch.full((total, n if trans_w else k), float("nan"))
    got = want.clone()
    nt.grouped_bf16(trans_w, a, dense, want, plan[0], plan[1], plan[2], plan[3], threads=3, isa=isa)
    native_quant.grouped(trans_w, a, w, got, plan, threads=3, isa=isa)
    assert torch.equal(got[:54], want[:54])
    assert torch.isnan(got[54:]).all()


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_int4_scales_of_other_dtypes(scale_dtype, rng):
    """compressed-tensors files keep the scale in the model's dtype: fp16 and float32 read too."""
    print(f"seed {rng.initial_seed()}")
    w = quantized("int4", 2, 40, 96, rng, scale_dtype=scale_dtype)
    dense = w.dequantize_all(torch.bfloat16).contiguous()
    a = torch.randn(9, 96, generator=rng)
    plan = torch.tensor([[1], [0], [9], [0]], dtype=torch.int64)
    want, got = torch.empty(9, 80), torch.empty(9, 80)
    nt.grouped_bf16(True, a, dense, want, *plan, threads=2)
    native_quant.grouped(True, a, w, got, plan, threads=2)
    assert torch.equal(got, want)


def test_unsupported_and_mismatched_parts_are_refused(rng):
    w = quantized("int8", 2, 8, 16, rng)
    t = QuantizedExperts(w.fmt, w.parts, w.part_rows, w.cols, w.dtype, transposed=True)
    assert "transposed" in native_quant.unsupported(t)
    a, out = torch.randn(3, 16), torch.empty(3, 16)
    plan = torch.tensor([[0], [0], [3], [0]], dtype=torch.int64)
    parts = native_quant.quant_parts(w)
    with pytest.raises(ValueError, match="do not add up"):  # parts of 16 rows, w said to have 17
        nt.grouped_quant(True, a, parts, (2, 17, 16), torch.empty(3, 17), *plan)
    nt.grouped_quant(True, a, parts, (2, 16, 16), out, *plan)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512bf16"])
@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_native_backend_on_quantized_experts_is_the_dequantized_base(fmt, isa, monkeypatch, rng):
    """The whole op (forward and backward, expert LoRA, masked pairs) on quantized experts against
    the same backend on their dequantized bf16 weights: the GEMMs are bitwise those, so the op is."""
    need(isa)
    print(f"seed {rng.initial_seed()}")
    c = CASES["skewed"]
    base, lora, x, ids, w, gy = make_problem(
        c["T"], c["E"], c["k"], 64, 32, 4, torch.bfloat16, rng, ids=c["ids"]
    )
    ids = ids.clone()
    ids[::5, 1] = -1
    w = w.masked_fill(ids < 0, 0)
    f = FORMATS[fmt]
    qbase = ExpertWeights(
        QuantizedExperts.from_dense(f, base.gate_up), QuantizedExperts.from_dense(f, base.down)
    )
    dbase = ExpertWeights(qbase.gate_up.dequantize_all(), qbase.down.dequantize_all())
    monkeypatch.setenv("KT_FT_NATIVE_ISA", isa)
    got = run_backend("native", qbase, lora, x, ids, w, gy, 2.0)
    want = run_backend("native", dbase, lora, x, ids, w, gy, 2.0)
    assert_close(want, got, 0.0)


def test_auto_picks_native_for_quantized_experts():
    backend, why = select_backend("auto", torch.bfloat16, None, "fp8")
    assert backend.name == "native", why
    assert "fp8" in why
