"""transformers' RMSNorm modules through ``torch.nn.functional.rms_norm``.

Why: the training step is bound by the host's per-operator work (docs/benchmarks.md), and a
transformers RMSNorm is 8 operators forward (cast to fp32, square, mean, add, rsqrt, product, cast
back, weight) and ~12 kernels backward, four times a layer in Qwen3-MoE (input, after attention,
the q and k heads) and once more for each pass of LLaMA-Factory's checkpointed recompute.
``F.rms_norm`` computes the same fp32 normalisation in one operator (one fused kernel forward and
backward on CUDA); the casts and the weight's product stay as transformers writes them, so the
result differs from transformers' by the fp32 reduction's order only.

Which modules: instances of classes named ``*RMSNorm`` with a ``weight`` of one dimension and a
``variance_epsilon``. A class is patched only after its own forward and the replacement agreed on a
random input (families that normalise otherwise, e.g. Gemma's ``1 + weight``, keep their forward).
``KT_FT_FUSIONS`` without ``norm`` keeps every class's own forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from kt_ft.base.log import get_logger
from kt_ft.base.settings import fusions

logger = get_logger(__name__)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama-style RMSNorm: weight * (x / rms(x) in fp32, cast back to x's dtype). [..., H] -> [..., H]."""
    dtype = hidden_states.dtype
    normed = F.rms_norm(
        hidden_states.to(torch.float32), (hidden_states.shape[-1],), eps=self.variance_epsilon
    )
    return self.weight * normed.to(dtype)


def _agrees(module: torch.nn.Module) -> bool:
    """The module's own forward and the replacement on one random input, within bf16 rounding."""
    weight = module.weight
    if weight.device.type == "meta":
        return False
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(3, weight.shape[0], generator=gen, device=weight.device, dtype=torch.float32).to(
        weight.dtype
    )
    with torch.no_grad():
        want = type(module).forward(module, x).float()
        got = _rms_norm_forward(module, x).float()
    if want.shape != got.shape:
        return False
    return bool(((want - got).abs() <= 1e-2 * want.abs().max() + 1e-6).all())


def install_fused_rms_norm(model: torch.nn.Module) -> int:
    """Give every Llama-style RMSNorm of ``model`` the ``F.rms_norm`` forward; returns how many (logged)."""
    if "norm" not in fusions():
        return 0
    verdict: dict[type, bool] = {}
    count = 0
    for module in model.modules():
        cls = type(module)
        if not cls.__name__.endswith("RMSNorm") or "_kt_ft_norm" in module.__dict__:
            continue
        weight = getattr(module, "weight", None)
        if (
            not isinstance(weight, torch.Tensor)
            or weight.dim() != 1
            or not hasattr(module, "variance_epsilon")
        ):
            continue
        if cls not in verdict:
            verdict[cls] = _agrees(module)
        if verdict[cls]:
            module._kt_ft_norm = True
            module.forward = types.MethodType(_rms_norm_forward, module)
            count += 1
    if verdict:
        kept = sorted(c.__name__ for c, ok in verdict.items() if not ok)
        logger.info(
            f"RMSNorm: {count} modules through torch's rms_norm (KT_FT_FUSIONS without norm: their own forward)"
            + (f"; their own forward kept for {', '.join(kept)} (it normalises otherwise)" if kept else "")
        )
    return count
