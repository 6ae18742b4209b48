"""The contract every CPU expert backend implements.

Shapes (E experts, H hidden, I expert intermediate, r LoRA rank, T tokens, k experts per token):

* base weights (frozen, CPU): ``gate_up`` [E, 2I, H] (rows :I gate, I: up), ``down`` [E, H, I]
  -- transformers v5's fused layout, kept as loaded (no copy);
* expert LoRA (the fused layout of DESIGN.md): ``gate_a``/``up_a`` [E, r, H], ``gate_b``/``up_b``
  [E, I, r], ``down_a`` [E, r, I], ``down_b`` [E, H, r];
* per call: ``x`` [T, H], ``ids`` [T, k] int64, ``weights`` [T, k] (routing weights).

For expert e and its tokens x, with s = lora_alpha / r:
g = x Wg^T + s (x Ag^T) Bg^T, u = x Wu^T + s (x Au^T) Bu^T, h = silu(g) * u,
d = h Wd^T + s (h Ad^T) Bd^T, out_t = sum_k w_tk d_tk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

LORA_NAMES = ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for sums over experts and for returned grads: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class LoraTensors(NamedTuple):
    """The six expert-LoRA tensors, each stacked over experts on dim 0 (see module doc for shapes)."""

    gate_a: torch.Tensor
    gate_b: torch.Tensor
    up_a: torch.Tensor
    up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor


@dataclass
class ExpertWeights:
    """Frozen base weights of one MoE layer's routed experts, in CPU memory."""

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]

    @property
    def hidden(self) -> int:
        return self.down.shape[1]


class ExpertBackend(ABC):
    """Computes one chunk of routed-expert forward and backward on the CPU.

    ``forward`` returns the output [T, H] (compute or accum_dtype, summed over the k experts) and an opaque
    context; ``backward`` takes that context and grad_out [T, H] and returns
    ``(grad_x [T, H], grad_weights [T, k], LoraTensors of grads)``, all in accum_dtype.
    A backend holds no per-call state: the context carries everything the backward needs.
    """

    name: ClassVar[str]

    @classmethod
    def unavailable_reason(cls, dtype: torch.dtype | None = None) -> str | None:
        """None when this backend can run here (for expert weights of ``dtype``), else why not."""
        return None

    def prepare(self, weights: ExpertWeights, threads: int | None = None, max_tokens: int = 4096) -> None:  # noqa: B027
        """Called once per layer before the first call (e.g. to repack weights).

        ``threads``: CPU threads to use; ``max_tokens``: the most tokens one call will get.
        """

    def lora_updated(self) -> None:  # noqa: B027 - optional hook
        """Called after the optimizer changed the LoRA tensors."""

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        base: ExpertWeights,
        lora: LoraTensors,
        scaling: float,
        needs_grad: bool,
    ) -> tuple[torch.Tensor, Any]: ...

    @abstractmethod
    def backward(
        self, ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, LoraTensors]: ...
