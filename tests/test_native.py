"""kt-ft's native CPU GEMMs (``kernels/expert_gemm.cpp`` via ``kt_ft/backends/native.py``) and the
``native`` backend.

GEMMs, every path (``PATHS``) this CPU runs, forced one at a time; a path the CPU lacks skips
with the reason (CI's AVX2-only runner still tests scalar and avx2). Against a float64 matmul of
the bf16 weights on fresh random inputs of odd shapes (M not a multiple of any row tile: 6, 12,
16/32; N not of the 16/32-column panels, the 128/512-column work items; K not of the 32-deep AMX
step or the 256/512 blocks) and row strides, NT and NN, beta 0, 1 and 0.5, 1 and 4 threads:

* fp32 paths (scalar, avx2, avx512) sum exact bf16 x fp32 products in fp32, only in another order:
  tolerance ``GEMM_TOL`` 1e-5 of the largest |entry| (K <= 600: measured worst ~1e-6);
* bf16 paths (avx512bf16, amx) round A to bf16 (to nearest even) first, then sum exact
  bf16 x bf16 products in fp32: against the reference on A rounded the same way (torch's
  ``.bfloat16()``), ``GEMM_TOL`` again; against unrounded A, elementwise
  |err| <= 2^-8 * (|A| @ |B|) + ``GEMM_TOL`` * max (2^-8: bf16's unit roundoff, A's only rounding).

Backend: against the float64 reference loop on the same rounded inputs, the cases of
test_kernels.py; on the fp32 paths the native backend computes in fp32 even for bf16 weights, so
its tolerance is fp32's 2e-5 for both weight dtypes (measured worst ~1e-6). On the bf16 paths
every base product's input is rounded to bf16 first: ``BF16_OP_TOL`` (below). The seed is
printed (shown on failure).

Everything skips, with the reason, only when the library cannot be built on this machine.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import CASES, assert_close, run_backend
from helpers.moe_inputs import make_problem

from kt_ft.backends import native as nt
from kt_ft.backends import native_build
from kt_ft.backends.base import ExpertWeights, LoraTensors
from kt_ft.backends.registry import BACKENDS, select_backend
from kt_ft.base.errors import KTConfigError

GEMM_TOL = 1e-5
OP_TOL = 2e-5
U_BF16 = 2.0**-8  # bf16's unit roundoff (8 significant bits, round to nearest even)
# The op on the bf16 paths: each base product's error is <= U_BF16 * sum|a w| (A's rounding);
# for these unit-variance problems (K <= 64) sum|a w| is at most ~2x the product's largest
# |entry|, and an output goes through up to 3 such products (gate_up, down; backward: the
# forward's h, then two more): 8 * U_BF16 ~ 3e-2 of the largest entry (measured worst 1.4e-3
# over 4 seeds of helpers.kernels.CASES on amx and avx512bf16).
BF16_OP_TOL = 8 * U_BF16
PATHS = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]  # slowest first, KT_FT_NATIVE_ISA's choices


@pytest.fixture(scope="module", autouse=True)
def library():
    why = nt.unavailable_reason()
    if why is not None:
        pytest.skip(f"native CPU kernels cannot be built here: {why}")
    print(f"native library {nt.library()._name}, best ISA {nt.best_isa()}")


def isas() -> list[str]:
    return nt.runnable_isas() if nt.unavailable_reason() is None else ["scalar"]


def need(isa: str) -> None:
    """Skip, saying why, when this CPU (or its OS) does not run the path ``isa``."""
    if isa not in isas():
        pytest.skip(f"this CPU runs {', '.join(isas())}: no {isa} path here")


def rounded(isa: str, a: torch.Tensor) -> torch.Tensor:
    """A as the path ``isa`` multiplies it: rounded to bf16 (to nearest even) on the bf16 paths."""
    return a.bfloat16().float() if isa in nt.ROUNDS_TO_BF16 else a


def check_product(isa, a, b, got, before, beta) -> None:
    """got = beta * before + a @ b on path isa, within the module docstring's tolerances."""
    acc = beta * before.double() if beta else 0
    want = rounded(isa, a).double() @ b.double() + acc
    assert rel_err(want, got) <= GEMM_TOL
    if isa in nt.ROUNDS_TO_BF16:  # against the unrounded A: bf16's rounding bound, elementwise
        exact = a.double() @ b.double() + acc
        bound = U_BF16 * (a.double().abs() @ b.double().abs()) + GEMM_TOL * exact.abs().max()
        assert ((got.double() - exact).abs() <= bound).all()


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((ref.double() - got.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def seeded(rng) -> torch.Generator:
    print(f"seed {rng.initial_seed()}")
    return rng


# (M, N, K); NN's output has K columns and sums over N
SHAPES = [
    (1, 1, 1),
    (5, 17, 33),
    (7, 37, 300),
    (13, 16, 256),
    (6, 130, 257),
    (49, 161, 600),
    (37, 300, 530),  # AMX: 2 + 1 m tiles, a 12-row W tile, 17 steps (the last 18 deep), 2 NN items
    (32, 64, 64),  # whole tiles everywhere
    (150, 40, 100),  # A rounded in three work items of 64 rows, the last 22 (bf16 paths)
]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_nt_and_nn_match_matmul(isa, beta, threads, shape, rng):
    need(isa)
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
    nt.gemm_bf16_nt(x, w, out, beta, threads=threads, isa=isa)
    check_product(isa, x, w.float().T, out, before, beta)
    assert torch.isnan(out_full[:, :3]).all() if beta == 0.0 else True  # columns outside untouched

    dy = torch.randn(m, n + 2, generator=g)[:, :n]
    dx_full = torch.randn(m, k + 4, generator=g)
    dx = dx_full[:, :k]
    before, outside = dx.clone(), dx_full[:, k:].clone()
    nt.gemm_bf16_nn(dy, w, dx, beta, threads=threads, isa=isa)
    check_product(isa, dy, w.float(), dx, before, beta)
    assert torch.equal(dx_full[:, k:], outside)


def test_isa_from_the_setting(monkeypatch, rng):
    """KT_FT_NATIVE_ISA (kt_ft/base/settings.py) picks the path when no argument does; a bad value is refused."""
    g = seeded(rng)
    x, w = torch.randn(9, 70, generator=g), torch.randn(20, 70, generator=g).bfloat16()
    results = {}
    for isa in isas():
        monkeypatch.setenv("KT_FT_NATIVE_ISA", isa)
        results[isa] = nt.gemm_bf16_nt(x, w, torch.empty(9, 20))
        check_product(isa, x, w.float().T, results[isa], None, 0.0)
    for isa in set(isas()) & set(nt.ROUNDS_TO_BF16):  # the setting took effect: A was rounded
        assert not torch.equal(results[isa], results["scalar"])
    monkeypatch.setenv("KT_FT_NATIVE_ISA", "avx9")
    with pytest.raises(ValueError, match="KT_FT_NATIVE_ISA='avx9'.*valid: auto, scalar, avx2, avx512"):
        nt.gemm_bf16_nt(x, w, torch.empty(9, 20))


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def test_best_isa_is_the_cpus_best():
    """The library's CPUID/XGETBV detection against Linux's own flags (which it lists only for
    features the kernel enabled: AMX ones include the tile state)."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    needs = {
        "avx2": {"avx2", "fma"},
        "avx512": {"avx512f"},
        "avx512bf16": {"avx512_bf16", "avx512bw", "avx512vl"},
        "amx": {"amx_tile", "amx_bf16"},
    }
    want = "scalar"
    for isa, required in needs.items():  # each path needs the previous ones' features too
        if not required <= flags:
            break
        want = isa
    assert nt.best_isa() == want


def test_forced_path_the_cpu_lacks_is_refused(monkeypatch):
    """Forcing a path above the CPU's best raises an error naming the setting, the value and what
    runs here, and the library itself refuses it (-2, C untouched). On a CPU that has every path,
    ``ktft_limit_isa`` makes the library report an AVX2-only CPU (CI's) for the test."""
    lib = nt.library()
    x, w = torch.randn(3, 40), torch.randn(5, 40).bfloat16()
    real_best = nt.best_isa()
    try:
        lib.ktft_limit_isa(nt.ISAS["avx2"])
        assert nt.best_isa() == ("avx2" if "avx2" in isas() else "scalar")
        lacking = [isa for isa in PATHS if nt.ISAS[isa] > nt.ISAS[nt.best_isa()]]
        assert {"avx512", "avx512bf16", "amx"} <= set(lacking)
        for isa in lacking:
            monkeypatch.setenv("KT_FT_NATIVE_ISA", isa)
            with pytest.raises(RuntimeError, match=f"KT_FT_NATIVE_ISA='{isa}': this CPU .*does not run it"):
                nt.gemm_bf16_nt(x, w, torch.empty(3, 5))
            out = torch.full((3, 5), float("nan"))
            code = lib.ktft_gemm_bf16(1, 3, 5, 40, x.data_ptr(), 40, w.data_ptr(), 40, out.data_ptr(), 5,
                                      0.0, 2, nt.ISAS[isa])  # fmt: skip
            assert code == -2 and torch.isnan(out).all()
    finally:
        lib.ktft_limit_isa(0)
    assert nt.best_isa() == real_best


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("trans_w", [True, False])
def test_grouped_gemm(isa, trans_w, rng):
    """Experts over row ranges of shared buffers in one call; padding rows zeroed; rows outside
    every range (and an expert with no rows but padding) as specified."""
    need(isa)
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
        if rows:
            check_product(isa, a[r0 : r0 + rows], wf.T if trans_w else wf, out[r0 : r0 + rows], None, 0.0)
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

    assert ctypes.CDLL(str(lib)).ktft_abi_version() == nt.ABI_VERSION
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
    rounds = dtype == torch.bfloat16 and nt.best_isa() in nt.ROUNDS_TO_BF16  # auto: the best path
    assert_close(truth, got, BF16_OP_TOL if rounds else OP_TOL)


@pytest.mark.parametrize("isa", PATHS)
def test_native_backend_per_path_and_masked_pairs(isa, monkeypatch, rng):
    """Each C++ path through the whole op (KT_FT_NATIVE_ISA forced), forward and backward, with
    masked pairs (id -1, computed elsewhere): the float64 reference within fp32 rounding (fp32
    paths) or within BF16_OP_TOL (bf16 paths, which also must differ from the scalar path: the
    rounding shows the forced path ran)."""
    need(isa)
    base, lora, x, ids, w, gy = make_problem(29, 6, 3, 40, 24, 4, torch.bfloat16, seeded(rng))
    ids[::4, 1] = -1
    w = w.masked_fill(ids < 0, 0)
    up = [t.double() for t in (base.gate_up, base.down, *lora, x, w, gy)]
    truth = run_backend(
        "reference", ExpertWeights(*up[:2]), LoraTensors(*up[2:8]), up[8], ids, up[9], up[10], 2.0
    )
    monkeypatch.setenv("KT_FT_NATIVE_ISA", isa)
    got = run_backend("native", base, lora, x, ids, w, gy, 2.0)
    assert_close(truth, got, BF16_OP_TOL if isa in nt.ROUNDS_TO_BF16 else OP_TOL)
    if isa in nt.ROUNDS_TO_BF16:
        monkeypatch.setenv("KT_FT_NATIVE_ISA", "scalar")
        assert not torch.equal(got["out"], run_backend("native", base, lora, x, ids, w, gy, 2.0)["out"])


def test_native_backend_availability_and_auto():
    """bf16 plain experts only; other layouts and dtypes are refused with the reason; ``auto``
    takes it on CPUs without native bf16 for bf16 weights, else passes it over (saying why)."""
    from helpers.moe_inputs import GPT_OSS_SPEC

    from kt_ft.backends.native_backend import cpu_has_native_bf16

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
        # the dev-tree build command (`python -m kt_ft.backends.native --build`) fills the cache
        assert nt.main(["--build"]) == 0
        assert nt.unavailable_reason() is None
        assert list((tmp_path / "cache" / "native").glob(f"*/{native_build.LIB_NAME}"))
    finally:
        monkeypatch.undo()
        nt._load.cache_clear()


@pytest.mark.parametrize("isa", PATHS)
def test_native_backend_keeps_gate_up_in_bf16_only_on_the_rounding_paths(isa, monkeypatch, rng):
    """Between a forward and its backward the op keeps the gate/up pre-activations: bf16 on the
    paths that round the products' inputs to bf16 (half the bytes every layer holds until its
    backward), fp32 on the fp32 paths; the backward reads them back either way (the per-path test
    above checks its results)."""
    need(isa)
    monkeypatch.setenv("KT_FT_NATIVE_ISA", isa)
    base, lora, x, ids, w, _ = make_problem(17, 4, 2, 32, 16, 4, torch.bfloat16, seeded(rng))
    backend = BACKENDS["native"]()
    backend.prepare(base, threads=1)
    _, ctx = backend.forward(x, ids, w, base, lora, 2.0, needs_grad=True)
    want = torch.bfloat16 if isa in nt.ROUNDS_TO_BF16 else torch.float32
    assert ctx.gu.dtype == want and ctx.p.dtype == torch.float32, (isa, ctx.gu.dtype)


ACT_PATHS = ["scalar", "avx2", "avx512"]  # the activation's paths (vector widths 4, 8, 16)


@pytest.mark.parametrize("isa", ACT_PATHS)
@pytest.mark.parametrize("gu_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1, 37, 64])
def test_activation_kernels_match_torch(isa, gu_dtype, inter, rng):
    """``kernels/expert_act.cpp`` against float64 torch on fresh random inputs, rows of odd widths
    (the vector loop's tails) and row strides, plus values where exp over/underflows (|g| up to
    200, the clamp) and tiny ones. Forward: h within 1e-5 relative + 1e-6 of the largest |h|
    (its exp is a polynomial: measured ~2e-6 relative worst); the bf16 copy bit-equal to torch's
    rounding. Backward: h, dgu and the row sums within 1e-5 of each one's largest |entry|
    (silu' crosses zero, so elementwise relative error is unbounded there)."""
    need(isa)
    g = seeded(rng)
    n = 29
    gu_full = torch.randn(n, 2 * inter + 3, generator=g) * 4  # 3 extra columns: a row stride
    gu_full[0, : min(8, 2 * inter)] = torch.tensor([-200.0, -90.0, 88.5, 200.0, 1e-30, -3e-3, 0.0, 40.0])[
        : min(8, 2 * inter)
    ]
    gu32 = gu_full[:, : 2 * inter]
    h = torch.full((n, inter), float("nan"))
    keep = torch.empty(n, 2 * inter, dtype=torch.bfloat16)
    nt.silu_mul_forward(gu32, h, keep, threads=3, isa=isa)
    g64, u64 = gu32[:, :inter].double(), gu32[:, inter:].double()
    want = torch.nn.functional.silu(g64) * u64
    assert ((h.double() - want).abs() <= 1e-5 * want.abs() + 1e-6 * want.abs().max()).all(), rel_err(want, h)
    assert torch.equal(keep, gu32.bfloat16())

    gu = gu32.to(gu_dtype)
    q = torch.randn(n, inter, generator=g)
    w = torch.rand(n, generator=g)
    w[3] = 0.0  # a padding row
    hb, dgu, gw = (
        torch.full((n, inter), float("nan")),
        torch.full((n, 2 * inter), float("nan")),
        torch.empty(n),
    )
    nt.silu_mul_backward(gu, q, w, hb, dgu, gw, threads=2, isa=isa)
    g64, u64 = gu[:, :inter].double(), gu[:, inter:].double()
    sg = torch.sigmoid(g64)
    h64 = g64 * sg * u64
    dh = q.double() * w.double()[:, None]
    dgu64 = torch.cat([dh * u64 * sg * (1 + g64 * (1 - sg)), dh * g64 * sg], 1)
    for name, ref, got in (("h", h64, hb), ("dgu", dgu64, dgu), ("grad_w", (h64 * q.double()).sum(1), gw)):
        assert rel_err(ref, got) <= 1e-5, (name, rel_err(ref, got))
    assert (dgu[3] == 0).all()


def test_activation_kernels_refuse_wrong_inputs():
    gu, h = torch.randn(4, 8), torch.empty(4, 4)
    with pytest.raises(ValueError, match="h must be torch.float32"):
        nt.silu_mul_forward(gu, torch.empty(4, 5))
    with pytest.raises(ValueError, match="keep must be torch.bfloat16"):
        nt.silu_mul_forward(gu, h, keep=torch.empty(4, 8))
    with pytest.raises(ValueError, match="gu must be float32 or bfloat16"):
        nt.silu_mul_backward(gu.half(), h, torch.rand(4), h, gu, torch.empty(4))
    with pytest.raises(ValueError, match="w must be"):
        nt.silu_mul_backward(gu, h, torch.rand(5), h, gu.clone(), torch.empty(4))


@pytest.mark.parametrize("isa", ACT_PATHS)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_match_torch(isa, src_dtype, rng):
    """``kernels/expert_rows.cpp`` against torch on fresh random inputs, odd widths and row strides:
    the gather (bf16 rows widened) is exact; the combine (a routing-weighted sum over each token's
    k slots, null rows included, and the unweighted one) within 1e-6 of the largest |entry| (fp32
    sums in another order than torch's batched product)."""
    need(isa)
    g = seeded(rng)
    t, k, n, cols = 11, 3, 40, 37
    src = torch.randn(t, cols + 5, generator=g).to(src_dtype)[:, :cols]  # a row stride
    idx = torch.randint(0, t, (n,), generator=g)
    out = torch.full((n, cols), float("nan"))
    nt.gather_rows(src, idx, out, threads=3, isa=isa)
    assert torch.equal(out, src.float()[idx])

    rows = torch.randn(n, cols, generator=g)
    inv = torch.randint(0, n, (t * k,), generator=g)
    inv[:2] = n - 1  # pairs pointing at one (null) row
    w = torch.rand(t, k, generator=g)
    for weights in (w, None):
        got = nt.combine_rows(rows, inv, weights, torch.full((t, cols), float("nan")), threads=2, isa=isa)
        ww = torch.ones(t, k) if weights is None else weights
        want = (ww.double()[:, :, None] * rows.double()[inv].view(t, k, cols)).sum(1)
        assert rel_err(want, got) <= 1e-6


def test_row_kernels_refuse_wrong_inputs():
    src, out = torch.randn(4, 8), torch.empty(3, 8)
    with pytest.raises(ValueError, match="an index is outside 0..3"):
        nt.gather_rows(src, torch.tensor([0, 1, 4]), out)
    with pytest.raises(ValueError, match="src must be float32 or bfloat16"):
        nt.gather_rows(src.half(), torch.tensor([0, 1, 2]), out)
    with pytest.raises(ValueError, match="index must be contiguous int64"):
        nt.combine_rows(src, torch.tensor([0, 1, 2], dtype=torch.int32), None, out)
    with pytest.raises(ValueError, match="weights must be"):
        nt.combine_rows(src, torch.tensor([0, 1, 2]), torch.rand(3, 2), out)
