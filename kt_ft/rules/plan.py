"""Turn a RuleSet and a model into a placement plan: which routed experts run where.

Walks ``model.named_modules()`` once; the first matching rule wins; ``recursive: false``
hands a matched module's whole subtree to that rule. A rule that matches no module is an
error. In this version routed experts run on the CPU and every other module on the
training device (the rule's default); other placements are refused with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import KTConfigError
from ..log import get_logger
from ..models import MoEFamily, find_routed_experts, layer_index
from .loader import Rule, RuleSet

logger = get_logger(__name__)


@dataclass
class ExpertPlacement:
    name: str  # dotted module name
    layer: int  # decoder-layer index
    device: str
    backend: str  # backend name or "auto"
    threads: int | None
    rule: Rule | None


@dataclass
class PlacementPlan:
    source: str
    experts: list[ExpertPlacement]
    default_device: torch.device
    notes: list[str] = field(default_factory=list)


def resolve_device(device: str) -> tuple[torch.device, str | None]:
    """A rule's device as a torch.device; `cuda` without CUDA falls back to cpu (note returned)."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return torch.device("cpu"), f"device {device!r} asked for but CUDA is not available: using cpu"
        idx = int(device.split(":")[1]) if ":" in device else 0
        if idx >= torch.cuda.device_count():
            raise KTConfigError(
                f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return torch.device(device), None


def _assign(model, rules: RuleSet) -> dict[str, Rule | None]:
    """Module name -> the rule that places it (None: default)."""
    assigned: dict[str, Rule | None] = {}
    inherited: list[tuple[str, Rule]] = []  # (prefix, rule) of matched `recursive: false` rules
    for name, module in model.named_modules():
        owner = next((rule for prefix, rule in inherited if name.startswith(prefix)), None)
        if owner is None:
            owner = next((rule for rule in rules.rules if rule.matches(name, module)), None)
            if owner is not None and not owner.recursive:
                inherited.append((f"{name}." if name else "", owner))
        assigned[name] = owner
    return assigned


def make_plan(
    model, rules: RuleSet, family: MoEFamily, kt_backend: str, cpu_infer: int | None
) -> PlacementPlan:
    assigned = _assign(model, rules)
    problems = []
    hits = {id(rule): 0 for rule in rules.rules}
    for rule in assigned.values():
        if rule is not None:
            hits[id(rule)] += 1
    for rule in rules.rules:
        if hits[id(rule)] == 0:
            problems.append(f"{rule.where}: {rule.describe()} matches no module of this model")

    default_device, note = resolve_device(rules.default_device)
    notes = [note] if note else []
    experts = []
    expert_names = set()
    for name, _ in find_routed_experts(model, family):
        expert_names.add(name)
        rule = assigned[name]
        device = rule.device if rule is not None else rules.default_device
        if device != "cpu":
            where = rule.where if rule is not None else rules.default_where
            problems.append(
                f"{where}: routed experts {name} placed on {device!r}; this version of kt-ft computes routed "
                "experts on 'cpu' only (GPU-resident experts arrive with `gpu_experts`)"
            )
            continue
        backend = kt_backend if kt_backend != "auto" else (rule.backend if rule and rule.backend else "auto")
        threads = rule.threads if rule is not None and rule.threads is not None else cpu_infer
        experts.append(ExpertPlacement(name, layer_index(name), device, backend, threads, rule))
    reported: set[int] = set()
    for name, rule in assigned.items():
        if rule is None or id(rule) in reported or name in expert_names:
            continue
        if any(name.startswith(f"{e}.") for e in expert_names):
            continue
        if rule.device != rules.default_device and resolve_device(rule.device)[0] != default_device:
            problems.append(
                f"{rule.where}: module {name} placed on {rule.device!r}; this version of kt-ft runs every "
                f"non-expert module on the training device ({rules.default_device!r})"
            )
            reported.add(id(rule))
    if not experts and not problems:
        problems.append(
            f"{rules.source}: no routed-experts module ({family.experts_class}) found in the model"
        )
    if problems:
        raise KTConfigError(problems)
    return PlacementPlan(rules.source, experts, default_device, notes)
