"""The contract every CPU expert backend implements.

Shapes (E experts, H hidden, I expert intermediate, r LoRA rank, T tokens, k experts per token):

* base weights (frozen, CPU): ``gate_up`` [E, 2I, H] (rows :I gate, I: up), ``down`` [E, H, I]
  -- transformers v5's fused layout, kept as loaded (no copy);
* expert LoRA (the fused layout of DESIGN.md): ``gate_a``/``up_a`` [E, r, H], ``gate_b``/``up_b``
  [E, I, r], ``down_a`` [E, r, I], ``down_b`` [E, H, r];
* per call: ``x`` [T, H], ``ids`` [T, k] int64, ``weights`` [T, k] (routing weights).

Masked pairs: a (token, slot) with a negative id (-1) is computed elsewhere (by a GPU-resident
expert, ``moe/resident.py``); every backend skips it: it adds nothing to the output and gets
zero gradient for x, its routing weight and the LoRA (the caller zeroes its weight too).

For expert e and its tokens x, with s = lora_alpha / r:
g = x Wg^T + s (x Ag^T) Bg^T, u = x Wu^T + s (x Au^T) Bu^T, h = silu(g) * u,
d = h Wd^T + s (h Ad^T) Bd^T, out_t = sum_k w_tk d_tk.

Families whose experts differ (gpt_oss) say how in an ``ExpertSpec`` carried by their
``ExpertWeights``: transposed weights (``gate_up`` [E, H, 2I], ``down`` [E, I, H], computed as
x W), gate/up interleaved (gate columns 0::2, up 1::2), frozen biases (``gate_up_bias`` [E, 2I]
in the same column order, ``down_bias`` [E, H]), and the activation (``kernels/activation.py``).
The LoRA tensors keep the per-projection shapes above whatever the base layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for sums over experts and for returned grads: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Caches of the expert LoRA in another form (a bf16 cast, a device copy, a host mirror, kt-kernel's
# copy) are keyed on ``lora_key``: the tensors' storages and version counters, and a generation
# that every optimizer step advances. Why not the version counters alone: torch's fused AdamW
# (``fused=True``; transformers' default optimizer ``adamw_torch_fused``) updates parameters in
# place without bumping them, so a version-keyed cache kept step 1's LoRA for the whole run.
_lora_generation = 0
_step_hook = None


def lora_changed() -> None:
    """Mark every cached form of the expert LoRA stale (kt-ft's loaders call it after writing the
    parameters; optimizer steps do through ``watch_optimizer_steps``)."""
    global _lora_generation
    _lora_generation += 1


def watch_optimizer_steps() -> None:
    """Register (once per process) a global post-step hook on every torch optimizer that calls
    ``lora_changed``."""
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook  # why: a submodule

        _step_hook = register_optimizer_step_post_hook(lambda *_: lora_changed())


def lora_key(params) -> tuple:
    """The identity of ``params``' current values for a cache: the generation, and each tensor's
    storage and version counter (in-place changes outside an optimizer step)."""
    return (_lora_generation, *((p.data_ptr(), p._version) for p in params))


class LoraTensors(NamedTuple):
    """The six expert-LoRA tensors, each stacked over experts on dim 0 (see module doc for shapes)."""

    gate_a: torch.Tensor
    gate_b: torch.Tensor
    up_a: torch.Tensor
    up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor


# gated activations the CPU op computes (kernels/activation.py); transformers' act_fn names: silu,
# gelu_pytorch_tanh (gelu_tanh), gelu (erf)
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "gpt_oss_clamped")


@dataclass(frozen=True)
class ExpertSpec:
    """How one family stores and activates its routed experts (the default: transformers v5's
    silu-gated fused layout, ``gate_up`` [E, 2I, H] rows :I gate / I: up, no biases).

    ``activation``: ``silu`` (h = silu(g) * u), ``gelu_tanh`` / ``gelu`` (h = gelu(g) * u, tanh
    approximation or exact erf) or ``gpt_oss_clamped`` (g clamped to <= limit,
    u to [-limit, limit], h = (u + 1) * g * sigmoid(alpha * g)); ``transposed``: ``gate_up``
    [E, H, 2I] and ``down`` [E, I, H], used as x @ W; ``interleaved``: gate/up alternate along
    the 2I axis (gate 0::2, up 1::2) instead of halves.
    """

    activation: str = "silu"
    transposed: bool = False
    interleaved: bool = False
    alpha: float = 1.702  # gpt_oss_clamped only
    limit: float = 7.0  # gpt_oss_clamped only

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ExpertSpec.activation={self.activation!r}; valid: {', '.join(ACTIVATIONS)}")

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_SPEC

    def gate_up_cols(self, inter: int) -> tuple[slice, slice]:
        """(gate, up) slices of the 2I axis of gate_up (and of its bias)."""
        if self.interleaved:
            return slice(0, 2 * inter, 2), slice(1, 2 * inter, 2)
        return slice(0, inter), slice(inter, 2 * inter)

    def describe(self) -> str:
        if self.is_default:
            return "silu(gate) * up"
        if self.activation != "gpt_oss_clamped":
            return (
                f"{self.activation}(gate) * up, {'transposed' if self.transposed else 'row-major'}, "
                f"gate/up {'interleaved' if self.interleaved else 'halves'}"
            )
        return (
            f"{self.activation} (alpha {self.alpha:g}, limit {self.limit:g}), "
            f"{'transposed' if self.transposed else 'row-major'}, "
            f"gate/up {'interleaved' if self.interleaved else 'halves'}"
        )


DEFAULT_SPEC = ExpertSpec()


@dataclass
class ExpertWeights:
    """Frozen base weights of one MoE layer's routed experts, in CPU memory (HF's tensors, no copy)."""

    gate_up: torch.Tensor  # [E, 2I, H]; [E, H, 2I] when spec.transposed
    down: torch.Tensor  # [E, H, I]; [E, I, H] when spec.transposed
    gate_up_bias: torch.Tensor | None = None  # [E, 2I], columns as gate_up's 2I axis
    down_bias: torch.Tensor | None = None  # [E, H]
    spec: ExpertSpec = DEFAULT_SPEC
    # resident experts kept with their expert LoRA beside them (``kernels/grouped_wide.py``): gate_up
    # and down are then views of its buffers
    wide: object | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate(self) -> int:
        return self.down.shape[1] if self.spec.transposed else self.down.shape[2]

    @property
    def hidden(self) -> int:
        return self.down.shape[2] if self.spec.transposed else self.down.shape[1]

    @property
    def quantized(self) -> str | None:
        """The storage format name when the weights are kept quantized (``kt_ft.backends.quant``), else None.
        ``gate_up[e]`` / ``down[e]`` then dequantize expert e alone (no other indexing)."""
        fmt = getattr(self.gate_up, "fmt", None)
        return None if fmt is None else fmt.name

    @property
    def is_plain(self) -> bool:
        """The default layout with no biases: what every backend computes."""
        return self.spec.is_default and self.gate_up_bias is None and self.down_bias is None

    def expert(self, e: int) -> tuple[torch.Tensor, ...]:
        """Views (no copy) of expert e as per-projection weights: (Wg [I, H], Wu [I, H], Wd [H, I],
        bg [I] | None, bu [I] | None, bd [H] | None)."""
        gs, us = self.spec.gate_up_cols(self.intermediate)
        if self.spec.transposed:
            gu, wd = self.gate_up[e].t(), self.down[e].t()  # [2I, H], [H, I]
        else:
            gu, wd = self.gate_up[e], self.down[e]
        b = self.gate_up_bias
        return (
            gu[gs],
            gu[us],
            wd,
            None if b is None else b[e, gs],
            None if b is None else b[e, us],
            None if self.down_bias is None else self.down_bias[e],
        )


class ExpertBackend(ABC):
    """Computes one chunk of routed-expert forward and backward on the CPU.

    ``forward`` returns the output [T, H] (compute or accum_dtype, summed over the k experts) and an opaque
    context; ``backward`` takes that context and grad_out [T, H] and returns
    ``(grad_x [T, H], grad_weights [T, k], LoraTensors of grads)``, all in accum_dtype.
    A backend holds no per-call state: the context carries everything the backward needs.
    """

    name: ClassVar[str]
    auto_note: ClassVar[str] = ""  # appended to auto's log line when auto picks this backend

    @classmethod
    def unavailable_reason(
        cls, dtype: torch.dtype | None = None, spec: ExpertSpec | None = None
    ) -> str | None:
        """None when this backend can run here (for expert weights of ``dtype`` and layout/activation
        ``spec``, None: the default), else why not."""
        return None

    @classmethod
    def auto_skip_reason(cls, dtype: torch.dtype | None = None, spec: ExpertSpec | None = None) -> str | None:
        """None when ``auto`` may pick this backend where it runs, else why a later one is preferred
        here (e.g. it was measured slower on this kind of CPU)."""
        return None

    def prepare(self, weights: ExpertWeights, threads: int | None = None, max_tokens: int = 4096) -> None:  # noqa: B027
        """Called once per layer before the first call (e.g. to repack weights).

        ``threads``: CPU threads to use; ``max_tokens``: the most tokens one call will get.
        """

    def lora_updated(self) -> None:  # noqa: B027 - optional hook
        """Called after the optimizer changed the LoRA tensors."""

    def holds_base_copy(self) -> bool:
        """True once the backend keeps a copy of the layer's base weights of its own (kt-kernel's
        packed one) and never reads the ``ExpertWeights`` it was given again: the runner may then
        free that host copy (``ExpertRunner.free_base_when_held``)."""
        return False

    def layer_backward_done(self) -> None:  # noqa: B027 - optional hook
        """Called once after the backward of every chunk of this layer's call (kt-kernel: start the
        next layer's backward weight repack, ``kt_kernel_backend.chain_backward_order``)."""

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
