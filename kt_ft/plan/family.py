"""Per-family facts: which modules are the routed experts, and the tiny demo config.

transformers v5 stores routed experts fused (``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]; gpt_oss transposed, interleaved and with biases) and calls them as
``experts(hidden_states, top_k_index, top_k_weights)``; the router, shared experts and dense
layers are other modules that stay on the GPU path. The hand-written families are listed in
``families.py``; any other model type whose experts class transformers decorated with
``use_experts_implementation`` gets a family derived from its modules (``derived.py``,
``interface.py``); ``expert_spec`` turns a family's expert layout into the kernels' ExpertSpec.
"""

from __future__ import annotations

import re
from typing import Any

from kt_ft.base.errors import KTConfigError
from kt_ft.plan.families import FAMILIES, UNSUPPORTED, MoEFamily
from kt_ft.plan.interface import derive_spec

__all__ = [
    "FAMILIES",
    "UNSUPPORTED",
    "MoEFamily",
    "check_routed_experts",
    "expert_spec",
    "family_of",
    "find_routed_experts",
    "layer_index",
]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


def family_of(config) -> MoEFamily:
    """The family of a transformers config (its ``model_type``), checked against what kt-ft computes:
    a hand-written one (``families.py``), else one derived from the model's experts-interface
    modules on the meta device (``derived.py``; KTConfigError before any weight is read when the
    CPU op cannot compute them)."""
    model_type = getattr(config, "model_type", None)
    if model_type in UNSUPPORTED:
        raise KTConfigError(f"model_type={model_type!r} is not supported by kt-ft: {UNSUPPORTED[model_type]}")
    if model_type not in _BY_MODEL_TYPE:
        from kt_ft.plan.derived import (
            derive_family,  # why: derived.py builds on the rules' meta skeleton (a layer up)
        )

        return derive_family(config)
    family = _BY_MODEL_TYPE[model_type]
    # composite (vision-language) configs keep the language model's keys in text_config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    act = getattr(text, "hidden_act", family.activation)
    if family.activation is not None and act != family.activation:
        raise KTConfigError(
            f"hidden_act={act!r} in the {model_type} config: kt-ft's CPU expert op computes "
            f"{family.activation}(gate) * up only; valid: {family.activation!r}"
        )
    return family


def layer_index(module_name: str) -> int:
    """Decoder-layer index from a dotted module name (`...layers.12.mlp.experts` -> 12)."""
    m = _LAYER_RE.search(module_name)
    if m is None:
        raise ValueError(f"no decoder-layer index in module name {module_name!r}")
    return int(m.group(1))


def expert_spec(family: MoEFamily, module: Any):
    """The kernels' ExpertSpec for ``module``, a routed-experts module of ``family`` (layout-checked
    by ``check_routed_experts``); gpt_oss's alpha and limit are read from the module."""
    from kt_ft.backends.base import DEFAULT_SPEC, ExpertSpec  # why: torch-free module; kernels import torch

    if family.expert_layout == "interface":
        spec, problems = derive_spec(unwrap_peft(module))
        if spec is None:
            raise KTConfigError([f"{type(module).__name__}: {p}" for p in problems])
        return spec
    if family.expert_layout == "gpt_oss":
        return ExpertSpec(
            "gpt_oss_clamped",
            transposed=True,
            interleaved=True,
            alpha=float(module.alpha),
            limit=float(module.limit),
        )
    return DEFAULT_SPEC


def check_routed_experts(name: str, module: Any, family: MoEFamily | None = None) -> None:
    """Refuse an experts module that is not the layout the CPU op computes for ``family`` (None: the
    default ``fused_silu`` layout), naming what differs.

    ``fused_silu``: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], no bias tensors, a silu
    ``act_fn`` and transformers' default gate (silu(gate) * up on the halves :I / I:).
    ``gpt_oss``: see ``_gpt_oss_problems``.
    """
    if family is not None and family.expert_layout == "interface":
        problems = derive_spec(module)[1]
    elif family is not None and family.expert_layout == "gpt_oss":
        problems = _gpt_oss_problems(module)
    else:
        problems = _fused_silu_problems(module)
    if problems:
        raise KTConfigError([f"routed experts {name} ({type(module).__name__}): {p}" for p in problems])


def _fused_silu_problems(module: Any) -> list[str]:
    from torch import nn

    problems = []
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        problems.append("expected 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
    else:
        e, two_i, h = gate_up.shape
        if getattr(module, "is_transposed", False) or two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
            problems.append(
                f"gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} are not "
                "[E, 2I, H] / [E, H, I]"
            )
    biases = [n for n, _ in module.named_parameters(recurse=False) if n.endswith("bias")]
    if biases or getattr(module, "has_bias", False):
        problems.append(f"has bias tensors {biases or '(has_bias=True)'}; the CPU op has none")
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        problems.append(f"act_fn is {type(act).__name__}, the CPU op computes silu(gate) * up")
    try:  # a family-specific gate (e.g. a clamped activation) replaces transformers' default one
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # pragma: no cover - older transformers: nothing to compare against
        _default_apply_gate = None
    gate_fn = getattr(type(module), "_apply_gate", _default_apply_gate)
    if _default_apply_gate is not None and gate_fn is not _default_apply_gate:
        problems.append(f"overrides _apply_gate ({gate_fn.__qualname__}): not silu(gate) * up")
    return problems


def _gpt_oss_problems(module: Any) -> list[str]:
    """transformers 5.6's GptOssExperts: gate_up_proj [E, H, 2I] + gate_up_proj_bias [E, 2I],
    down_proj [E, I, H] + down_proj_bias [E, H], used as x @ W + b (``is_transposed``,
    ``has_bias``), and an ``_apply_gate`` that computes kt-ft's clamped swish on interleaved
    gate/up columns: checked by running it on probe values on both sides of the limits."""
    import torch

    from kt_ft.backends.activation import gated_act  # why: as in expert_spec

    params = {
        n: getattr(module, n, None)
        for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    }
    missing = [n for n, t in params.items() if t is None]
    if missing:
        return [f"missing {missing}; expected gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], "
                "down_proj [E, I, H], down_proj_bias [E, H]"]  # fmt: skip
    e, h, two_i = params["gate_up_proj"].shape if params["gate_up_proj"].dim() == 3 else (0, 0, 0)
    expected = {"gate_up_proj": (e, h, two_i), "gate_up_proj_bias": (e, two_i),
                "down_proj": (e, two_i // 2, h), "down_proj_bias": (e, h)}  # fmt: skip
    problems = [
        f"{n} {tuple(params[n].shape)} is not {expected[n]} ([E, H, 2I], [E, 2I], [E, I, H], [E, H])"
        for n in params
        if tuple(params[n].shape) != expected[n] or two_i == 0 or two_i % 2
    ]
    if not getattr(module, "is_transposed", False) or not getattr(module, "has_bias", False):
        problems.append(
            f"is_transposed={getattr(module, 'is_transposed', None)}, has_bias={getattr(module, 'has_bias', None)}: "
            "expected True, True (x @ W + b)"
        )
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)) or limit <= 0:
        return [*problems, f"alpha={alpha!r}, limit={limit!r}: expected positive numbers"]
    spec = expert_spec(FAMILIES["gpt_oss"], module)
    # probe values from -3 limit to 3 limit on the interleaved (gate, up) columns
    z = torch.linspace(-3 * limit, 3 * limit, 64, dtype=torch.float64).view(4, 16)
    z = torch.cat([z, z.flip(1)], dim=0)
    try:
        got = module._apply_gate(z)
    except Exception as err:  # noqa: BLE001 - any failure means it is not the activation we compute
        return [*problems, f"_apply_gate failed on a probe tensor ({type(err).__name__}: {err})"]
    want = gated_act(z[..., ::2], z[..., 1::2], spec)
    if (
        not isinstance(got, torch.Tensor)
        or got.shape != want.shape
        or not torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    ):
        problems.append(
            f"_apply_gate ({type(module).__name__}) does not compute kt-ft's clamped swish on interleaved "
            f"gate/up columns ((clamp(up, -{limit:g}, {limit:g}) + 1) * g * sigmoid({alpha:g} g), g = min(gate, {limit:g}))"
        )
    return problems


def unwrap_peft(module):
    """The module inside PEFT's ``ParamWrapper`` layers (itself when not wrapped)."""
    while type(module).__name__ == "ParamWrapper" and hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def _outermost_peft_wrapper(model, name: str) -> str:
    """The name to replace for the experts module at ``name``: the outermost PEFT wrapper around it.

    Newer PEFT (0.21) matches LoRA targets such as ``down_proj`` against the fused experts'
    parameters too and wraps the module in ``ParamWrapper`` layers (``experts.base_layer...``).
    kt-ft trains the expert LoRA itself, so it replaces the whole wrapper chain: PEFT's expert
    LoRA would otherwise run on top of kt-ft's and be a second, GPU-side copy of the work.
    """
    while name.endswith(".base_layer"):
        parent = name[: -len(".base_layer")]
        if type(model.get_submodule(parent)).__name__ != "ParamWrapper":
            break
        name = parent
    return name


def find_routed_experts(model, family: MoEFamily) -> list[tuple[str, Any]]:
    """(dotted name, module) of every routed-experts module, in model order, layout-checked.

    Only MoE layers have one (dense layers of first-k-dense / mlp_only_layers families have an
    MLP instead), so the names carry the real decoder-layer indices.
    """
    found = [
        (_outermost_peft_wrapper(model, n), m)
        for n, m in model.named_modules()
        if type(m).__name__ in family.experts_classes
    ]
    for name, module in found:
        check_routed_experts(name, module, family)
    return found
