"""Fast CPU expert backends vs the pure-torch reference, on fresh random inputs.

The truth is the reference loop run in float64 on the same (already rounded) inputs.
Tolerance: max abs error divided by the truth's max abs value, per tensor: fp32 2e-5 (same
math, other summation order); bf16 6e-2 (8 mantissa bits; over 900 random problems of these
cases the fast path's worst was 4.2%, on grad_weights of a single token, where the bf16
reference loop itself reaches 9.7%). The float64 gradcheck uses torch's defaults.
"""

from __future__ import annotations

import pytest
import torch
from moe_inputs import make_problem

from kt_ft.kernels import BACKENDS, LoraTensors, reference_moe
from kt_ft.kernels.base import ExpertWeights
from kt_ft.moe.function import CPUExpertsFunction, ExpertRunner

TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-2}
# Portable fast backends; kt-kernel (bf16 only, AMX tile shapes) has its own test file.
FAST = ["torch"]


def run_backend(name, base, lora, x, ids, w, gy, scaling):
    be = BACKENDS[name]()
    be.prepare(base)
    out, ctx = be.forward(x, ids, w, base, lora, scaling, True)
    gx, gw, gl = be.backward(ctx, gy)
    return {"out": out, "grad_x": gx, "grad_weights": gw, **{f"grad_{k}": v for k, v in gl._asdict().items()}}


def assert_close(ref: dict, got: dict, tol: float):
    assert ref.keys() == got.keys()
    for key in ref:
        a, b = ref[key].double(), got[key].double()
        assert a.shape == b.shape, key
        scale = a.abs().max().clamp_min(1e-12)
        err = ((a - b).abs().max() / scale).item()
        assert err <= tol, f"{key}: relative error {err:.3e} > {tol:.0e}"


CASES = {
    "random": dict(T=53, E=8, k=2, ids=None),
    "expert_without_tokens": dict(T=5, E=16, k=2, ids=None),  # 10 pairs over 16 experts
    "all_tokens_one_expert": dict(T=17, E=6, k=1, ids=torch.zeros(17, 1, dtype=torch.long)),
    "one_expert_shared_by_all": dict(
        T=9, E=6, k=3, ids=torch.stack([torch.tensor([0, 2 + i % 4, 1]) for i in range(9)])
    ),
    "single_token": dict(T=1, E=4, k=2, ids=None),
    "top_k_equals_E": dict(T=11, E=4, k=4, ids=None),
}


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_backend_matches_reference(backend, dtype, case, rng):
    c = CASES[case]
    base, lora, x, ids, w, gy = make_problem(c["T"], c["E"], c["k"], 64, 48, 4, dtype, rng, ids=c["ids"])
    if case == "expert_without_tokens":
        assert ids.unique().numel() < c["E"]
    up = [t.double() for t in (base.gate_up, base.down, *lora, x, w, gy)]
    truth = run_backend(
        "reference", ExpertWeights(*up[:2]), LoraTensors(*up[2:8]), up[8], ids, up[9], up[10], 2.0
    )
    got = run_backend(backend, base, lora, x, ids, w, gy, 2.0)
    assert_close(truth, got, TOL[dtype])


def test_reference_backend_is_the_plain_loop(rng):
    """The reference backend's forward is reference_moe itself (guards the ground truth's wiring)."""
    base, lora, x, ids, w, gy = make_problem(13, 5, 2, 32, 24, 3, torch.float64, rng)
    out = run_backend("reference", base, lora, x, ids, w, gy, 0.5)["out"]
    torch.testing.assert_close(out, reference_moe(x, ids, w, base, lora, 0.5), rtol=0, atol=0)
    # and it is not trivially zero / independent of LoRA
    lora2 = LoraTensors(*(t * 2 for t in lora))
    assert not torch.allclose(out, reference_moe(x, ids, w, base, lora2, 0.5))


@pytest.mark.parametrize("backend", ["reference", *FAST])
def test_gradcheck_float64(backend, rng):
    base, lora, x, ids, w, _ = make_problem(6, 4, 2, 8, 6, 2, torch.float64, rng)
    runner = ExpertRunner(BACKENDS[backend](), base, 1.5, chunk_size=4, threads=None)
    inputs = [x.requires_grad_(), w.requires_grad_(), *(t.requires_grad_() for t in lora)]

    def f(x, w, *lora_t):
        return CPUExpertsFunction.apply(x, ids, w, runner, *lora_t)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("backend", ["reference", *FAST])
def test_chunking_matches_one_call(backend, rng):
    """chunk_size smaller than the batch splits it; the results equal one big call (fp32)."""
    base, lora, x, ids, w, gy = make_problem(37, 8, 2, 32, 24, 4, torch.float32, rng)
    results = []
    for chunk in (1000, 10):
        runner = ExpertRunner(BACKENDS[backend](), base, 2.0, chunk_size=chunk, threads=None)
        params = [t.clone().requires_grad_() for t in lora]
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = CPUExpertsFunction.apply(xx, ids, ww, runner, *params)
        out.backward(gy)
        results.append(
            {"out": out, "gx": xx.grad, "gw": ww.grad, **{str(i): p.grad for i, p in enumerate(params)}}
        )
        assert runner.forward_calls == 1
    assert_close(results[0], results[1], 2e-5)


def test_function_returns_input_dtype_and_no_grad_path(rng):
    base, lora, x, ids, w, _ = make_problem(7, 4, 2, 16, 8, 2, torch.float32, rng)
    runner = ExpertRunner(BACKENDS["torch"](), base, 1.0, chunk_size=64, threads=1)
    with torch.no_grad():
        out = CPUExpertsFunction.apply(x, ids, w, runner, *lora)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, reference_moe(x, ids, w, base, lora, 1.0), rtol=2e-5, atol=2e-6)


def test_expert_weights_shapes():
    base = ExpertWeights(torch.zeros(3, 10, 4), torch.zeros(3, 4, 5))
    assert (base.num_experts, base.hidden, base.intermediate) == (3, 4, 5)


def test_torch_backend_recycles_saved_buffers_safely(rng):
    """A layer's saved buffers are reused by its next forward once its backward ran; a second
    backward through the old context after that refuses instead of reading the new call's data."""
    base, lora, x, ids, w, gy = make_problem(20, 4, 2, 32, 16, 2, torch.float32, rng)
    be = BACKENDS["torch"]()
    out1, ctx1 = be.forward(x, ids, w, base, lora, 1.0, True)
    g1 = be.backward(ctx1, gy)
    g1_again = be.backward(ctx1, gy)  # retain_graph-style repeat before any new forward: fine
    torch.testing.assert_close(g1[0], g1_again[0], rtol=0, atol=0)
    out2, ctx2 = be.forward(x * 2, ids, w, base, lora, 1.0, True)
    assert ctx2.xs.data_ptr() == ctx1.xs.data_ptr(), "saved buffers were not recycled"
    with pytest.raises(RuntimeError, match="saved state was reused"):
        be.backward(ctx1, gy)
    fresh = BACKENDS["torch"]()
    expect = fresh.backward(fresh.forward(x * 2, ids, w, base, lora, 1.0, True)[1], gy)
    for got, want in zip(be.backward(ctx2, gy), expect):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
