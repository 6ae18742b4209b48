"""The family of a model type that has no hand-written entry, derived from its experts-interface modules.

``derive_family(config)`` builds the model on the meta device (no weight read, seconds even for
a 671B config), finds the modules whose class transformers decorated with
``use_experts_implementation`` (``interface.py``), maps each onto the CPU op's ExpertSpec, and
raises KTConfigError -- naming the model_type, what was found and what the op computes -- for
experts it cannot compute, before any weight is loaded. The interface says nothing about the
optimize rule, the LLaMA-Factory chat template or a recipe: ``OVERRIDES`` holds them where a type
needs its own; otherwise the built-in rule ``moe_experts`` (every module named ``experts`` on the
CPU) and no template apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kt_ft.base.errors import KTConfigError
from kt_ft.formats.skeleton import meta_model
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.families import MoEFamily
from kt_ft.plan.interface import derive_spec, interface_experts

GENERIC_RULE = "moe_experts"  # optimize_rules/moe_experts.yaml


@dataclass(frozen=True)
class Override:
    """What the interface does not say about a model type (None: the generic choice)."""

    template: str | None = None  # LLaMA-Factory chat template of the real instruct checkpoints
    builtin_rule: str | None = None  # optimize rule when the recipe names none
    recipe: str | None = None  # recipes/<recipe>


# LLaMA-Factory (0.9.x) template names of the instruct checkpoints; checked against the
# installed LLaMA-Factory's TEMPLATES by tests/test_interface_families.py.
OVERRIDES: dict[str, Override] = {
    "ernie4_5_moe": Override(template="ernie_nothink"),
    "exaone_moe": Override(template="exaone"),
    "gemma4_text": Override(template="gemma4"),
    "gemma4": Override(template="gemma4"),
    "hunyuan_v1_moe": Override(template="hunyuan"),
    "hy_v3": Override(template="hy3"),
    "lfm2_moe": Override(template="lfm2"),
    "minimax": Override(template="minimax1"),
    "minimax_m2": Override(template="minimax2"),
    "qwen3_next": Override(template="qwen3_nothink"),
    "qwen3_vl_moe": Override(
        template="qwen3_vl", builtin_rule="qwen3_vl_moe", recipe="qwen3_vl_30b_a3b.yaml"
    ),
    "glm4v_moe": Override(template="glm4v"),
}

_CACHE: dict[str, MoEFamily] = {}


def _cache_key(config) -> str:
    try:
        return config.to_json_string(use_diff=False)
    except (TypeError, ValueError):  # a value json cannot write: derive every time
        return ""


def derive_family(config) -> MoEFamily:
    """The MoEFamily of ``config``'s model from its experts-interface modules (see module doc)."""
    key = _cache_key(config)
    if key and key in _CACHE:
        return _CACHE[key]
    model_type = getattr(config, "model_type", None)
    found = interface_experts(meta_model(config, torch.bfloat16))
    if not found:
        raise KTConfigError(
            f"model_type={model_type!r} is not supported by kt-ft: none of its modules is a routed-experts "
            "class decorated with transformers' use_experts_implementation (and it has no hand-written "
            "entry in kt_ft/plan/families.py); kt-ft fine-tunes MoE models whose experts use that interface"
        )
    classes: dict[str, str] = {}  # class name -> its first module's name
    problems = []
    for name, module in found:
        cls = type(module).__name__
        if cls in classes:
            continue
        classes[cls] = name
        _, why = derive_spec(module)
        problems += [f"{cls} ({name}): {p}" for p in why]
    if problems:
        raise KTConfigError(
            [
                f"model_type={model_type!r} is not supported by kt-ft: its routed experts are not what the CPU op computes"
            ]
            + problems
        )
    over = OVERRIDES.get(model_type, Override())
    rule = over.builtin_rule or (model_type if resolve_rule_path(str(model_type)) else GENERIC_RULE)
    names = tuple(classes)
    family = MoEFamily(
        model_type=str(model_type),
        experts_class=names[0],
        experts_class_aliases=names[1:],
        activation=None,  # read off each module's _apply_gate (interface.py), not the config
        builtin_rule=rule,
        template=over.template or "",
        recipe=over.recipe or "",
        expert_layout="interface",
    )
    if key:
        _CACHE[key] = family
    return family
