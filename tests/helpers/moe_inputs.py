"""Random routed-expert problems for kernel tests."""

from __future__ import annotations

import torch

from kt_ft.backends.base import ExpertSpec, ExpertWeights, LoraTensors

# transformers' GptOssExperts: [E, H, 2I] / [E, I, H], gate/up interleaved, clamped swish (1.702, 7)
GPT_OSS_SPEC = ExpertSpec("gpt_oss_clamped", transposed=True, interleaved=True)


def make_problem(
    T: int,
    E: int,
    k: int,
    H: int,
    I: int,
    r: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    ids=None,
    spec: ExpertSpec | None = None,
    bias_scale: float | None = None,
):
    """Weights, LoRA (B non-zero so every path is exercised), inputs and an upstream grad, all drawn
    from ``gen`` in float64 and rounded to ``dtype``. Returns (base, lora, x, ids, weights, grad_out):
    base an ExpertWeights (gate_up [E, 2I, H], down [E, H, I]; [E, H, 2I] / [E, I, H] for a transposed
    ``spec``; biases [E, 2I] / [E, H] with ``bias_scale``), lora a LoraTensors (gate_a / up_a
    [E, r, H], gate_b / up_b [E, I, r], down_a [E, r, I], down_b [E, H, r]), x [T, H], ids [T, k]
    int64 (``ids`` if given, else k distinct experts a token), routing weights [T, k] (softmax) and
    grad_out [T, H].

    ``spec``: the base weights' layout/activation (default: plain silu [E, 2I, H]);
    ``bias_scale``: add gate_up/down biases N(0, bias_scale^2) (a large one pushes pre-activations
    past a clamp limit)."""

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    spec = spec or ExpertSpec()
    gate_up, down = rnd(E, 2 * I, H, scale=H**-0.5), rnd(E, H, I, scale=I**-0.5)
    if spec.transposed:  # the same distribution, stored [E, H, 2I] / [E, I, H]
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    biases = (None, None)
    if bias_scale is not None:
        biases = (rnd(E, 2 * I, scale=bias_scale), rnd(E, H, scale=bias_scale))
    base = ExpertWeights(gate_up, down, *biases, spec=spec)
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


def routed_problem(T: int, E: int, k: int, H: int, I: int, r: int, variant: str, routed: int | None = None):
    """A fresh float32 problem for the device-expert tests, seed drawn and printed: ``make_problem``'s
    base and LoRA (``variant`` "gpt_oss": its layout with biases N(0, 0.5^2); else the plain one),
    x [T, H], ids [T, k] of distinct experts among the first ``routed`` (default all E), routing
    weights [T, k] in [0, 1) and an upstream gradient [T, H]. Returns (base, lora, x, ids, w, grad, seed)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    spec, bias = (GPT_OSS_SPEC, 0.5) if variant == "gpt_oss" else (None, None)
    base, lora, x, _, _, _ = make_problem(T, E, k, H, I, r, torch.float32, gen, spec=spec, bias_scale=bias)
    ids = torch.stack([torch.randperm(E if routed is None else routed, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    grad = torch.randn(T, H, generator=gen)
    return base, lora, x, ids, w, grad, seed
