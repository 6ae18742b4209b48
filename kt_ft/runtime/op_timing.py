"""Time the CPU expert op on one random layer of a given shape: forward with saved state +
backward, best of a few runs. Shared by the machine's rate measurement
(``placement/measure.py``) and ``kt-ft bench --parts op`` (``bench/op.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kt_ft.backends.base import ExpertWeights, LoraTensors
from kt_ft.backends.registry import BACKENDS
from kt_ft.runtime.function import CPUExpertsFunction, ExpertRunner


@dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    layers: int  # of the real model (the op bench runs one layer)


def best_time(fn, repeat: int) -> float:
    fn()  # warm-up (allocations, kernel packing, thread pools)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def random_layer(p: Preset, rank: int, gen: torch.Generator):
    bf = torch.bfloat16

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(bf)

    base = ExpertWeights(
        rnd(p.experts, 2 * p.inter, p.hidden, scale=p.hidden**-0.5),
        rnd(p.experts, p.hidden, p.inter, scale=p.inter**-0.5),
    )
    lora = LoraTensors(
        rnd(p.experts, rank, p.hidden, scale=p.hidden**-0.5).float(),
        rnd(p.experts, p.inter, rank, scale=0.01).float(),
        rnd(p.experts, rank, p.hidden, scale=p.hidden**-0.5).float(),
        rnd(p.experts, p.inter, rank, scale=0.01).float(),
        rnd(p.experts, rank, p.inter, scale=p.inter**-0.5).float(),
        rnd(p.experts, p.hidden, rank, scale=0.01).float(),
    )
    return base, lora


def op_step(p: Preset, layer, backend: str, tokens: int, threads: int, gen: torch.Generator):
    """A function that runs the op's forward (with saved state) + backward once on ``tokens``
    random tokens of ``layer`` and returns the backward's seconds."""
    base, lora = layer
    x = torch.randn(tokens, p.hidden, generator=gen).to(torch.bfloat16)
    scores = torch.rand(tokens, p.experts, generator=gen)
    w, ids = scores.topk(p.top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    gy = torch.randn(tokens, p.hidden, generator=gen).to(torch.bfloat16)
    runner = ExpertRunner(BACKENDS[backend](), base, 2.0, chunk_size=max(tokens, 1), threads=threads)
    params = [t.clone().requires_grad_() for t in lora]

    def step() -> float:
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = CPUExpertsFunction.apply(xx, ids, ww, runner, *params)
        t0 = time.perf_counter()
        out.backward(gy)
        for q in params:
            q.grad = None
        return time.perf_counter() - t0

    return step


def time_op(
    p: Preset, layer, backend: str, tokens: int, threads: int, repeat: int, gen: torch.Generator
) -> float:
    """Best seconds of the op's forward (with saved state) + backward on ``tokens`` random tokens."""
    return best_time(op_step(p, layer, backend, tokens, threads, gen), repeat)
