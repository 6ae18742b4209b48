"""kt-ft's native CPU GEMMs (``kernels/expert_gemm.cpp`` via ``kt_ft/kernels/native.py``) and the
``native`` backend.

GEMMs: against torch's fp32 matmul of the upcast bf16 weights, on fresh random inputs of odd
shapes (M not a multiple of the 6-row tile, N of the 16-column panel, K of the 256 block) and
row strides, for the scalar path and the AVX2 path (where the CPU has it). Both sum exact
bf16 x fp32 products in fp32, only in another order: tolerance 1e-5 of the largest |entry|
(K <= 600: the measured worst is ~1e-6). The seed is printed (shown on failure).

Backend: against the float64 reference loop on the same rounded inputs, the cases of
test_kernels.py; the native backend computes in fp32 even for bf16 weights, so its tolerance is
fp32's 2e-5 for both weight dtypes (measured worst ~1e-6).

Everything skips, with the reason, only when the library cannot be built on this machine.
"""

from __future__ import annotations

import pytest
import torch
from moe_inputs import make_problem
from test_kernels import CASES, assert_close, run_backend

from kt_ft.errors import KTConfigError
from kt_ft.kernels import BACKENDS, LoraTensors, native_build, select_backend
from kt_ft.kernels import native as nt
from kt_ft.kernels.base import ExpertWeights

GEMM_TOL = 1e-5
OP_TOL = 2e-5


@pytest.fixture(scope="module", autouse=True)
def library():
    why = nt.unavailable_reason()
    if why is not None:
        pytest.skip(f"native CPU kernels cannot be built here: {why}")


def isas() -> list[str]:
    return ["scalar", "avx2"] if nt.unavailable_reason() is None and nt.best_isa() == "avx2" else ["scalar"]


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((ref.double() - got.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def seeded(rng) -> torch.Generator:
    print(f"seed {rng.initial_seed()}")
    return rng


SHAPES = [(1, 1, 1), (5, 17, 33), (7, 37, 300), (13, 16, 256), (6, 130, 257), (49, 161, 600)]


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_nt_and_nn_match_fp32_matmul(isa, beta, shape, rng):
    if isa not in isas():
        pytest.skip("this CPU has no AVX2+FMA")
    g = seeded(rng)
    m, n, k = shape
    # strided views: rows longer than the matrix for x, w and out
    x = torch.randn(m, k + 3, generator=g)[:, 1 : k + 1]
    w = torch.randn(n, k + 5, generator=g).bfloat16()[:, 2 : k + 2]
    out_full = torch.randn(m, n + 7, generator=g)
    if beta == 0.0:
        out_full.fill_(float("nan"))  # beta 0 must not read out
    out = out_full[:, 3 : n + 3]
    before = out.clone()
    want = x @ w.float().T + (beta * before if beta else 0)
    nt.gemm_bf16_nt(x, w, out, beta, threads=2, isa=isa)
    assert rel_err(want, out) <= GEMM_TOL
    assert torch.isnan(out_full[:, :3]).all() if beta == 0.0 else True  # columns outside untouched

    dy = torch.randn(m, n + 2, generator=g)[:, :n]
    dx = torch.randn(m, k, generator=g)
    before = dx.clone()
    want = dy @ w.float() + beta * before
    nt.gemm_bf16_nn(dy, w, dx, beta, threads=3, isa=isa)
    assert rel_err(want, dx) <= GEMM_TOL


def test_isa_from_the_setting(monkeypatch, rng):
    """KT_FT_NATIVE_ISA (kt_ft/settings.py) picks the path when no argument does; a bad value is refused."""
    g = seeded(rng)
    x, w = torch.randn(9, 70, generator=g), torch.randn(20, 70, generator=g).bfloat16()
    want = x @ w.float().T
    for isa in isas():
        monkeypatch.setenv("KT_FT_NATIVE_ISA", isa)
        assert rel_err(want, nt.gemm_bf16_nt(x, w, torch.empty(9, 20))) <= GEMM_TOL
    monkeypatch.setenv("KT_FT_NATIVE_ISA", "avx9")
    with pytest.raises(ValueError, match="avx9"):
        nt.gemm_bf16_nt(x, w, torch.empty(9, 20))


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("trans_w", [True, False])
def test_grouped_gemm(isa, trans_w, rng):
    """Experts over row ranges of shared buffers in one call; padding rows zeroed; rows outside
    every range (and an expert with no rows but padding) as specified."""
    if isa not in isas():
        pytest.skip("this CPU has no AVX2+FMA")
    g = seeded(rng)
    e, n, k = 5, 45, 70
    w = torch.randn(e, n, k, generator=g).bfloat16()
    groups = [(3, 0, 7, 2), (0, 9, 1, 0), (4, 10, 0, 3), (1, 13, 20, 1)]  # (expert, row0, rows, pad)
    total = 40  # rows 34.. belong to no range
    k_in, n_out = (k, n) if trans_w else (n, k)
    a = torch.randn(total, k_in, generator=g)
    out = torch.full((total, n_out), float("nan"))
    plan = torch.tensor(groups, dtype=torch.int64).t().contiguous()
    nt.grouped_bf16(trans_w, a, w, out, plan[0], plan[1], plan[2], plan[3], threads=2, isa=isa)
    for ex, r0, rows, pad in groups:
        wf = w[ex].float()
        want = a[r0 : r0 + rows] @ (wf.T if trans_w else wf)
        if rows:
            assert rel_err(want, out[r0 : r0 + rows]) <= GEMM_TOL
        assert (out[r0 + rows : r0 + rows + pad] == 0).all()
    assert torch.isnan(out[34:]).all()


def test_gemm_refuses_wrong_inputs():
    x, w, out = torch.randn(4, 8), torch.randn(6, 8).bfloat16(), torch.empty(4, 6)
    with pytest.raises(TypeError, match="w must be torch.bfloat16"):
        nt.gemm_bf16_nt(x, w.float(), out)
    with pytest.raises(TypeError, match="activations must be torch.float32"):
        nt.gemm_bf16_nt(x.bfloat16(), w, out)
    with pytest.raises(ValueError, match="shapes"):
        nt.gemm_bf16_nt(x, w, torch.empty(4, 5))
    with pytest.raises(ValueError, match="contiguous"):
        nt.gemm_bf16_nt(torch.randn(8, 4).T, w, out)
    with pytest.raises(ValueError, match="row range"):
        z = torch.zeros(1, dtype=torch.int64)
        nt.grouped_bf16(True, x, w[None], out, z, z, z + 5)


def test_build_into_a_directory_and_a_failing_compiler(tmp_path, monkeypatch):
    """The build function a dev tree and the install hook use: a library that loads, with the
    source hash beside it; a compiler that fails gives its reason instead of raising."""
    lib, why = native_build.build(tmp_path / "ok")
    assert lib is not None, why
    assert (tmp_path / "ok" / native_build.HASH_NAME).read_text() == native_build.source_hash()
    import ctypes

    assert ctypes.CDLL(str(lib)).ktft_abi_version() == 1
    monkeypatch.setenv("CXX", "false")  # a "compiler" that exits 1
    lib, why = native_build.build(tmp_path / "bad")
    assert lib is None and "failed (1)" in why
    assert not list((tmp_path / "bad").glob("*.so"))


# --- the native backend -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_native_backend_matches_reference(dtype, case, rng):
    c = CASES[case]
    base, lora, x, ids, w, gy = make_problem(
        c["T"], c["E"], c["k"], 64, 48, 4, dtype, seeded(rng), ids=c["ids"]
    )
    up = [t.double() for t in (base.gate_up, base.down, *lora, x, w, gy)]
    truth = run_backend(
        "reference", ExpertWeights(*up[:2]), LoraTensors(*up[2:8]), up[8], ids, up[9], up[10], 2.0
    )
    got = run_backend("native", base, lora, x, ids, w, gy, 2.0)
    assert_close(truth, got, OP_TOL)


def test_native_backend_scalar_path_and_masked_pairs(monkeypatch, rng):
    """The scalar C++ path through the whole op (KT_FT_NATIVE_ISA=scalar), with masked pairs
    (id -1, computed elsewhere): same results as the AVX2 path within fp32 rounding."""
    base, lora, x, ids, w, gy = make_problem(29, 6, 3, 40, 24, 4, torch.bfloat16, seeded(rng))
    ids[::4, 1] = -1
    w = w.masked_fill(ids < 0, 0)
    up = [t.double() for t in (base.gate_up, base.down, *lora, x, w, gy)]
    truth = run_backend(
        "reference", ExpertWeights(*up[:2]), LoraTensors(*up[2:8]), up[8], ids, up[9], up[10], 2.0
    )
    for isa in isas():
        monkeypatch.setenv("KT_FT_NATIVE_ISA", isa)
        assert_close(truth, run_backend("native", base, lora, x, ids, w, gy, 2.0), OP_TOL)


def test_native_backend_availability_and_auto():
    """bf16 plain experts only; other layouts and dtypes are refused with the reason; ``auto``
    takes it on CPUs without native bf16 for bf16 weights, else passes it over (saying why)."""
    from moe_inputs import GPT_OSS_SPEC

    from kt_ft.kernels.native_backend import cpu_has_native_bf16

    cls = BACKENDS["native"]
    assert cls.unavailable_reason(torch.bfloat16) is None
    assert "bf16 expert weights" in cls.unavailable_reason(torch.float32)
    assert "silu(gate) * up" in cls.unavailable_reason(torch.bfloat16, GPT_OSS_SPEC)
    with pytest.raises(KTConfigError, match="cannot run for these experts"):
        select_backend("native", torch.bfloat16, GPT_OSS_SPEC)
    backend, why = select_backend("auto", torch.bfloat16)
    if cpu_has_native_bf16():
        assert backend.name != "native"
    else:
        assert backend.name == "native", why
    assert select_backend("auto", torch.float32)[0].name == "torch"


def test_loader_without_a_library_says_how_to_build(tmp_path, monkeypatch):
    """No installed library, an empty cache and run-time builds off: unavailable, with the command;
    that command builds into the cache and the library loads from there."""
    monkeypatch.setattr(nt, "PACKAGED_DIR", tmp_path / "none")
    monkeypatch.setenv("KT_FT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KT_FT_NATIVE_BUILD", "0")
    nt._load.cache_clear()
    try:
        why = nt.unavailable_reason()
        assert why is not None and "KT_FT_NATIVE_BUILD=0" in why and "--build" in why
        assert BACKENDS["native"].unavailable_reason(torch.bfloat16) == why
        # the dev-tree build command (`python -m kt_ft.kernels.native --build`) fills the cache
        assert nt.main(["--build"]) == 0
        assert nt.unavailable_reason() is None
        assert list((tmp_path / "cache" / "native").glob(f"*/{native_build.LIB_NAME}"))
    finally:
        monkeypatch.undo()
        nt._load.cache_clear()
