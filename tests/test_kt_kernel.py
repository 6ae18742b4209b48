"""kt-kernel backend vs the float64 reference (runs where kt-kernel's AMX/AVX512-BF16 build loads:
the GPU machine's Xeon; skipped elsewhere with the reason).

Shapes are AMX-tile friendly (H 256, I 128). bf16 tolerance as in test_kernels: 6e-2 of the
truth's max per tensor.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import assert_close, run_backend
from helpers.moe_inputs import make_problem

from kt_ft.backends.base import ExpertWeights, LoraTensors
from kt_ft.backends.kt_kernel import chain_backward_order
from kt_ft.backends.registry import BACKENDS
from kt_ft.runtime.function import CPUExpertsFunction, ExpertRunner

REASON = BACKENDS["kt-kernel"].unavailable_reason(torch.bfloat16)
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"kt-kernel backend unavailable: {REASON}")


def truth_of(base, lora, x, ids, w, gy, scaling):
    up = [t.double() for t in (base.gate_up, base.down, *lora, x, w, gy)]
    return run_backend(
        "reference", ExpertWeights(*up[:2]), LoraTensors(*up[2:8]), up[8], ids, up[9], up[10], scaling
    )


@pytest.mark.parametrize("T", [1, 37, 300])
def test_kt_kernel_matches_reference(T, rng):
    base, lora, x, ids, w, gy = make_problem(T, 8, 2, 256, 128, 8, torch.bfloat16, rng)
    got = run_backend("kt-kernel", base, lora, x, ids, w, gy, 2.0)
    assert_close(truth_of(base, lora, x, ids, w, gy, 2.0), got, 6e-2)


def test_kt_kernel_chunks_and_lora_updates(rng):
    """Three chunks (the backend re-runs forwards it no longer holds) and a LoRA change between calls."""
    base, lora, x, ids, w, gy = make_problem(50, 8, 2, 256, 128, 8, torch.bfloat16, rng)
    params = [t.float().clone().requires_grad_() for t in lora]
    runner = ExpertRunner(BACKENDS["kt-kernel"](), base, 2.0, chunk_size=20, threads=4)
    for _ in range(2):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = CPUExpertsFunction.apply(xx, ids, ww, runner, *params)
        out.backward(gy)
        cur = LoraTensors(*(p.detach().to(torch.bfloat16) for p in params))
        truth = truth_of(base, cur, x, ids, w, gy, 2.0)
        got = {"out": out.float(), "grad_x": xx.grad.float(), "grad_weights": ww.grad.float()}
        got.update({f"grad_{n}": p.grad for n, p in zip(lora._fields, params)})
        assert_close(truth, got, 6e-2)
        with torch.no_grad():  # an optimizer step: the kernel must see the new LoRA next call
            for p in params:
                p.add_(torch.randn_like(p) * 0.05)
                p.grad = None


def test_kt_kernel_skips_masked_pairs(rng):
    """GPU-resident experts' pairs reach the CPU op with id -1 and weight 0 (kt_ft/runtime/resident.py):
    kt-kernel must skip them -- an assumption from its inference path, checked here. Against the
    float64 reference with those pairs' weights zeroed; their routing-weight grad must be 0."""
    base, lora, x, ids, w, gy = make_problem(37, 8, 2, 256, 128, 8, torch.bfloat16, rng)
    masked = ids < 3  # experts 0-2 "resident"
    ids_m, w_m = ids.masked_fill(masked, -1), w.masked_fill(masked, 0)
    got = run_backend("kt-kernel", base, lora, x, ids_m, w_m, gy, 2.0)
    truth = truth_of(base, lora, x, ids, w_m, gy, 2.0)
    assert (got["grad_weights"][masked] == 0).all()
    got["grad_weights"] = got["grad_weights"].masked_fill(masked, 0)
    truth["grad_weights"] = truth["grad_weights"].masked_fill(masked, 0)
    assert_close(truth, got, 6e-2)


@pytest.mark.parametrize("shared_cache", ["0", "1"])
@pytest.mark.parametrize("order", ["backward", "forward"])
def test_kt_kernel_layers_share_one_backward_pool_and_free_the_host_copy(
    order, shared_cache, rng, monkeypatch
):
    """Three layers in a chain (``chain_backward_order``, as ``moe/patch.py`` links them): their
    backward weights come from one shared pool, each layer's backward done starts the next one's
    repack, and kt-ft's host copy of each is freed once kt-kernel has loaded it. ``order``: the
    backwards in the chain's order (the repack prepared ahead is the right one) or in forward order
    (every guess wrong: each backward repacks its own). ``shared_cache``: KT_FT_KT_KERNEL_SHARED_CACHE
    (one pool of saved activations: every backward but the last forward's runs its forward again).
    Two steps with a LoRA change between, against the float64 reference on a kept copy of the
    weights; each layer has its own inputs (a pool holding another layer's activations shows)."""
    monkeypatch.setenv("KT_FT_KT_KERNEL_SHARED_CACHE", shared_cache)
    layers = [make_problem(40, 8, 2, 256, 128, 8, torch.bfloat16, rng) for _ in range(3)]
    keep = [ExpertWeights(p[0].gate_up.clone(), p[0].down.clone()) for p in layers]
    runners = [ExpertRunner(BACKENDS["kt-kernel"](), p[0], 2.0, chunk_size=64, threads=4) for p in layers]
    for r in runners:
        r.free_base_when_held = True
    chain_backward_order([r.backend for r in runners])
    params = [[t.float().clone().requires_grad_() for t in p[1]] for p in layers]
    for _ in range(2):
        outs, inputs = [], []
        for r, ps, (_, _, x, ids, w, _) in zip(runners, params, layers):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            outs.append(CPUExpertsFunction.apply(xx, ids, ww, r, *ps))
            inputs.append((xx, ww))
        seq = range(3) if order == "forward" else reversed(range(3))
        for i in seq:
            outs[i].backward(layers[i][5])
        for i, (base, _, x, ids, w, gy) in enumerate(layers):
            cur = LoraTensors(*(p.detach().to(torch.bfloat16) for p in params[i]))
            truth = truth_of(keep[i], cur, x, ids, w, gy, 2.0)
            got = {
                "out": outs[i].float(),
                "grad_x": inputs[i][0].grad.float(),
                "grad_weights": inputs[i][1].grad.float(),
            }
            got.update({f"grad_{n}": p.grad for n, p in zip(LoraTensors._fields, params[i])})
            assert_close(truth, got, 6e-2)
            assert runners[i].base_freed and base.gate_up.untyped_storage().nbytes() == 0
        with torch.no_grad():
            for p in (p for ps in params for p in ps):
                p.add_(torch.randn(p.shape, generator=rng) * 0.05)
                p.grad = None
