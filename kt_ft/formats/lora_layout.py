"""Expert-LoRA parameters: shapes and initialisation of the fused layout.

gate/up A [E, r, H], gate/up B [E, I, r], down A [E, r, I], down B [E, H, r]. A is
kaiming-uniform(a=sqrt 5) on its [E*r, in] view (what PEFT does for one expert's lora_A, so
a per-expert export starts from the same distribution); B is zeros, so training starts
from the base model's function.
"""

from __future__ import annotations

import math

import torch

# the six expert-LoRA tensors of a layer, in the order the backends take them
LORA_NAMES = ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")


def lora_scaling(*, rank: int, alpha: float, use_rslora: bool = False) -> float:
    """Same scaling as PEFT's LoRA: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def expert_lora_shapes(num_experts: int, hidden: int, inter: int, rank: int) -> dict[str, tuple[int, ...]]:
    e, h, i, r = num_experts, hidden, inter, rank
    return {
        "gate_a": (e, r, h),
        "gate_b": (e, i, r),
        "up_a": (e, r, h),
        "up_b": (e, i, r),
        "down_a": (e, r, i),
        "down_b": (e, h, r),
    }


def init_expert_lora(
    num_experts: int,
    hidden: int,
    inter: int,
    rank: int,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Fresh expert-LoRA tensors on the CPU, keyed by LORA_NAMES, in ``dtype``: drawn in float32
    and rounded once, so a bf16 LoRA (``pure_bf16``) starts from the fp32 one's values."""
    out = {}
    for name, shape in expert_lora_shapes(num_experts, hidden, inter, rank).items():
        t = torch.zeros(shape, dtype=torch.float32)
        if name.endswith("_a"):
            # kaiming_uniform_(a=sqrt(5)) on [E*r, in]: bound = gain * sqrt(3 / fan_in) = 1 / sqrt(in)
            bound = 1.0 / math.sqrt(shape[-1])
            t.uniform_(-bound, bound, generator=generator)
        out[name] = t.to(dtype)
    assert tuple(out) == LORA_NAMES
    return out
