"""Random routed-expert problems for kernel tests."""

from __future__ import annotations

import torch

from kt_ft.kernels import ExpertWeights, LoraTensors


def make_problem(
    T: int, E: int, k: int, H: int, I: int, r: int, dtype: torch.dtype, gen: torch.Generator, ids=None
):
    """Weights, LoRA (B non-zero so every path is exercised), inputs and an upstream grad."""

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    base = ExpertWeights(gate_up=rnd(E, 2 * I, H, scale=H**-0.5), down=rnd(E, H, I, scale=I**-0.5))
    lora = LoraTensors(
        gate_a=rnd(E, r, H, scale=H**-0.5),
        gate_b=rnd(E, I, r, scale=0.5),
        up_a=rnd(E, r, H, scale=H**-0.5),
        up_b=rnd(E, I, r, scale=0.5),
        down_a=rnd(E, r, I, scale=I**-0.5),
        down_b=rnd(E, H, r, scale=0.5),
    )
    x = rnd(T, H)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=gen, dtype=torch.float64), -1).to(dtype)
    grad_out = rnd(T, H)
    return base, lora, x, ids, weights, grad_out
