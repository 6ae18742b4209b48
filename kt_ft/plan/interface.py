"""Routed experts described by transformers' experts interface, mapped onto the CPU op's ExpertSpec.

transformers 5.x decorates a model's fused experts class with ``@use_experts_implementation(
is_transposed=..., has_bias=..., has_gate=...)`` (``transformers/integrations/moe.py``): every
instance then carries ``has_gate``, ``has_bias``, ``is_transposed`` and ``config``, a gate
function ``_apply_gate(gate_up_out [S, 2I]) -> [S, I]`` (default: ``chunk(2)`` then
``act_fn(gate) * up``; gpt_oss overrides it) and a ``forward(hidden_states [T, H], top_k_index
[T, k], top_k_weights [T, k])`` dispatched on ``config._experts_implementation``. Its weights:

* ``gate_up_proj`` [E, 2I, H] (``is_transposed``: [E, H, 2I], used as x @ W), ``down_proj``
  [E, H, I] (transposed: [E, I, H]); with ``has_bias`` also ``gate_up_proj_bias`` [E, 2I] and
  ``down_proj_bias`` [E, H];
* ``has_gate=False``: ``up_proj`` [E, I, H] and ``act_fn(up)`` -- an ungated MLP.

What the decorator does not say -- which activation ``_apply_gate`` computes and whether gate and
up are halves or interleaved -- is read off the module by running ``_apply_gate`` on a probe
tensor and comparing it with each gated activation the CPU op computes (``kernels/activation.py``)
in both column orders; the first that agrees (float64, rtol 1e-12) is the spec. Nothing is read
from the class name, so a renamed class (DeepseekV3NaiveMoe -> DeepseekV3Experts in 5.17) or a
new family needs no entry.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from kt_ft.backends.activation import gated_act
from kt_ft.backends.base import ACTIVATIONS, ExpertSpec

# gated activations tried on _apply_gate, in order (the clamped swish only where the module has
# numeric alpha and limit attributes, as gpt_oss's and openai_privacy_filter's experts do)
_PLAIN_ACTS = tuple(a for a in ACTIVATIONS if a != "gpt_oss_clamped")


@functools.cache
def _decorated_forward_code():
    """The code object of the ``forward`` the decorator installs (one per transformers install), or
    None where this transformers has no experts interface."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:  # transformers < 5: no interface, only the hand-written families
        return None

    class _Probe(nn.Module):
        def forward(self, hidden_states, top_k_index, top_k_weights):  # pragma: no cover - never run
            return hidden_states

    return use_experts_implementation(_Probe).forward.__code__


def is_interface_experts(module_or_class: Any) -> bool:
    """True when the class was decorated with transformers' ``use_experts_implementation``."""
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    code = _decorated_forward_code()
    forward = getattr(cls, "forward", None)
    return code is not None and getattr(forward, "__code__", None) is code


def interface_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(dotted name, module) of every experts-interface module of ``model``, in model order."""
    return [(n, m) for n, m in model.named_modules() if is_interface_experts(m)]


def _probe(module: nn.Module) -> torch.Tensor:
    """A float64 [16, 2I] probe for ``_apply_gate`` (I = 8): random values wide enough to cross a
    clamp limit on both sides, fixed seed so the verdict does not change between runs."""
    limit = getattr(module, "limit", None)
    scale = 2.0 * float(limit) if isinstance(limit, (int, float)) and limit > 0 else 4.0
    gen = torch.Generator().manual_seed(0)
    return torch.randn(16, 16, dtype=torch.float64, generator=gen) * scale


def _candidates(module: nn.Module, transposed: bool) -> list[ExpertSpec]:
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    specs = [ExpertSpec(a, transposed=transposed, interleaved=i) for a in _PLAIN_ACTS for i in (False, True)]
    if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)) and limit > 0:
        specs += [
            ExpertSpec("gpt_oss_clamped", transposed, i, alpha=float(alpha), limit=float(limit))
            for i in (False, True)
        ]
    return specs


def _gate_spec(module: nn.Module, transposed: bool) -> tuple[ExpertSpec | None, str]:
    """The spec whose gated activation ``module._apply_gate`` computes, else (None, what it did)."""
    z = _probe(module)
    try:
        got = module._apply_gate(z)
    except Exception as err:  # noqa: BLE001 - any failure: not an activation kt-ft computes
        return None, f"_apply_gate failed on a probe tensor ({type(err).__name__}: {err})"
    for spec in _candidates(module, transposed):
        gs, us = spec.gate_up_cols(z.shape[1] // 2)
        want = gated_act(z[:, gs], z[:, us], spec)
        if (
            isinstance(got, torch.Tensor)
            and got.shape == want.shape
            and torch.allclose(got, want, 1e-12, 1e-12)
        ):
            return spec, ""
    return None, "its _apply_gate matches none of them on a probe tensor"


def _shape_problems(module: nn.Module, transposed: bool, has_bias: bool) -> list[str]:
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return [f"parameters {sorted(params)}; expected 3-D gate_up_proj and down_proj"]
    if transposed:
        e, h, two_i = gate_up.shape
        want = {"gate_up_proj": (e, h, two_i), "down_proj": (e, two_i // 2, h)}
        form = "[E, H, 2I], [E, I, H]"
    else:
        e, two_i, h = gate_up.shape
        want = {"gate_up_proj": (e, two_i, h), "down_proj": (e, h, two_i // 2)}
        form = "[E, 2I, H], [E, H, I]"
    if has_bias:
        want |= {"gate_up_proj_bias": (e, two_i), "down_proj_bias": (e, h)}
        form += ", [E, 2I], [E, H]"
    got = {n: tuple(p.shape) for n, p in params.items()}
    if got != want or two_i % 2:
        return [
            f"parameters {got}; expected {want} ({form}: is_transposed={transposed}, has_bias={has_bias})"
        ]
    return []


def supported_text() -> str:
    acts = ", ".join(f"{a}(gate) * up" for a in _PLAIN_ACTS)
    return (
        f"gated experts (has_gate=True) computing {acts} or gpt_oss's clamped swish, gate/up as halves "
        "or interleaved, any is_transposed / has_bias"
    )


def derive_spec(module: nn.Module) -> tuple[ExpertSpec | None, list[str]]:
    """(the CPU op's spec for an experts-interface module, []) or (None, what kt-ft cannot compute)."""
    has_gate = getattr(module, "has_gate", True)
    transposed = bool(getattr(module, "is_transposed", False))
    has_bias = bool(getattr(module, "has_bias", False))
    act = type(getattr(module, "act_fn", None)).__name__
    if not has_gate:
        up = getattr(module, "up_proj", None)
        shape = tuple(up.shape) if isinstance(up, torch.Tensor) else None
        return None, [
            f"has_gate=False: an ungated MLP act_fn(x @ up_proj) (act_fn {act}, up_proj {shape}); "
            f"kt-ft's CPU op computes {supported_text()}"
        ]
    problems = _shape_problems(module, transposed, has_bias)
    spec, why = _gate_spec(module, transposed)
    if spec is None:
        gate = getattr(type(module), "_apply_gate", None)
        problems.append(
            f"act_fn {act}, _apply_gate {getattr(gate, '__qualname__', gate)}: {why}; "
            f"kt-ft's CPU op computes {supported_text()}"
        )
    return (spec if not problems else None), problems
