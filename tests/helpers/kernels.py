"""Running one CPU expert backend on a problem of ``helpers.moe_inputs`` and comparing two backends'
results (tests/test_kernels.py, and the kt-kernel, native and host-copy tests built on it)."""

from __future__ import annotations

import torch

from kt_ft.backends.registry import BACKENDS


def run_backend(name, base, lora, x, ids, w, gy, scaling) -> dict[str, torch.Tensor]:
    """A fresh ``BACKENDS[name]`` prepared for ``base``, one forward (LoRA ``lora`` x ``scaling``) of
    x [T, H] routed by ids [T, k] with weights w [T, k], then its backward of the upstream gradient
    gy [T, H]. Returns name -> tensor: ``out`` [T, H], ``grad_x`` [T, H], ``grad_weights`` [T, k] and
    ``grad_<lora name>`` of the six LoRA tensors (gate_a / up_a [E, r, H], gate_b / up_b [E, I, r],
    down_a [E, r, I], down_b [E, H, r]), in the dtypes the backend returns (not always x's: the
    reference returns float32 for bf16 inputs, the torch backend a bf16 ``out``)."""
    be = BACKENDS[name]()
    be.prepare(base)
    out, ctx = be.forward(x, ids, w, base, lora, scaling, True)
    gx, gw, gl = be.backward(ctx, gy)
    return {"out": out, "grad_x": gx, "grad_weights": gw, **{f"grad_{k}": v for k, v in gl._asdict().items()}}


def assert_close(ref: dict, got: dict, tol: float, overrides: dict[str, float] | None = None) -> None:
    """Two ``run_backend`` results have the same keys and shapes, and per key max |ref - got| divided
    by max |ref| (in float64) is within ``tol`` (``overrides``: another tolerance for some keys)."""
    assert ref.keys() == got.keys()
    for key in ref:
        tol_key = (overrides or {}).get(key, tol)
        a, b = ref[key].double(), got[key].double()
        assert a.shape == b.shape, key
        scale = a.abs().max().clamp_min(1e-12)
        err = ((a - b).abs().max() / scale).item()
        assert err <= tol_key, f"{key}: relative error {err:.3e} > {tol_key:.0e}"


# Routing cases: T tokens, E experts, top-k, and fixed expert ids [T, k] (None: drawn at random).
CASES = {
    "random": dict(T=53, E=8, k=2, ids=None),
    "expert_without_tokens": dict(T=5, E=16, k=2, ids=None),  # 10 pairs over 16 experts
    "all_tokens_one_expert": dict(T=17, E=6, k=1, ids=torch.zeros(17, 1, dtype=torch.long)),
    "one_expert_shared_by_all": dict(
        T=9, E=6, k=3, ids=torch.stack([torch.tensor([0, 2 + i % 4, 1]) for i in range(9)])
    ),
    "single_token": dict(T=1, E=4, k=2, ids=None),
    "top_k_equals_E": dict(T=11, E=4, k=4, ids=None),
    # padded row counts 48 / 32 / 16 / 0: the torch backend's LoRA products run as three groups
    "skewed": dict(
        T=40,
        E=5,
        k=2,
        ids=torch.tensor([[0, 1 + (i % 3 == 0)] if i < 34 else [3, 2] for i in range(40)]),
    ),
}
