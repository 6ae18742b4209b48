"""Turn a RuleSet and a model into a placement plan: which module goes where, how experts run.

Walks ``model.named_modules()`` once; the first matching rule wins; ``recursive: false``
hands a matched module's whole subtree to that rule. Always errors: a rule of the file itself
(included rules may be overridden) that matches no module, GPU-expert ids or counts the model does not have, and (for a run) a device this
machine does not have. ``gpu_experts`` runs (``moe/resident.py``), and ``stream``
(``moe/streamed.py``: its ids must not be resident, resident + streamed <= the layer's experts). Placements the schema
accepts but this version cannot run yet (routed experts off the CPU, non-expert modules on
another device than the default) are *refusals*: errors for a run, kept in ``plan.refusals`` for a planning-only call
(``kt-ft rules plan`` / ``check`` show them). The model may live on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.plan.families import MoEFamily
from kt_ft.plan.family import expert_spec, find_routed_experts, layer_index
from kt_ft.plan.homes import pick_resident_ids
from kt_ft.plan.loader import Rule, RuleSet, missing_devices
from kt_ft.plan.schema import GpuExpertSpec

logger = get_logger(__name__)


@dataclass
class ExpertPlacement:
    name: str  # dotted module name
    layer: int  # decoder-layer index
    device: str
    backend: str  # backend name or "auto"
    threads: int | None
    rule: Rule | None
    gpu_experts: GpuExpertSpec | None = None  # experts of this layer resident on the training device
    spec: Any = None  # the kernels' ExpertSpec of the family's layout (None: the default)
    # experts of this layer streamed to the training device each time the layer runs
    # (``moe/streamed.py``); ids and count None: every expert not resident (``stream: all``)
    stream_experts: GpuExpertSpec | None = None
    placement: str = "manual"  # "auto": kt_ft/placement fills gpu_experts / stream_experts at start
    # False: this layer's expert LoRA stays on the CPU even with experts on the GPU (the planner's
    # choice under a tight cap, ``placement/homes.py`` ``lora_home``); None: where lora_home puts it
    lora_on_gpu: bool | None = None


@dataclass
class PlacementPlan:
    source: str
    experts: list[ExpertPlacement]
    default_device: torch.device  # resolved on this machine (cuda -> cpu without CUDA)
    notes: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)  # planning-only: what a run would refuse
    module_devices: dict[str, str] = field(default_factory=dict)  # every module -> the rule's device string


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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


def _gpu_problems(rule: Rule, name: str, spec: GpuExpertSpec, num_experts: int) -> list[str]:
    path = f"{rule.where}: gpu_experts"
    if spec.ids is not None and any(i >= num_experts for i in spec.ids):
        bad = [i for i in spec.ids if i >= num_experts]
        return [f"{path}: expert ids {bad} do not exist in {name}; valid: 0-{num_experts - 1}"]
    if spec.count is not None and spec.count > num_experts:
        return [f"{path}: count {spec.count} > the {num_experts} experts of {name}; valid: 0-{num_experts}"]
    return []


def _stream_problems(
    rule: Rule, name: str, gpu: GpuExpertSpec | None, spec: GpuExpertSpec, num_experts: int
) -> list[str]:
    """A layer's ``stream`` entry against the model and its resident experts (a resident count
    takes ids 0..count-1, as at load: docs/placement.md "GPU-resident experts")."""
    path = f"{rule.where}: stream"
    resident = pick_resident_ids(num_experts, gpu.ids, gpu.count) if gpu is not None else ()
    rest = num_experts - len(resident)
    if spec.ids is not None:
        bad = [i for i in spec.ids if i >= num_experts]
        if bad:
            return [f"{path}: expert ids {bad} do not exist in {name}; valid: 0-{num_experts - 1}"]
        both = sorted(set(spec.ids) & set(resident))
        if both:
            return [
                f"{path}: expert ids {both} of {name} are both resident (gpu_experts {list(resident)}) and "
                "streamed; an expert has one placement: drop them from one of the two"
            ]
    if spec.count is not None and spec.count > rest:
        return [
            f"{path}: gpu_experts {len(resident)} + stream {spec.count} = {len(resident) + spec.count} > the "
            f"{num_experts} experts of {name}; valid stream counts: 0-{rest} (or `stream: all`)"
        ]
    return []


def make_plan(
    model,
    rules: RuleSet,
    family: MoEFamily,
    kt_backend: str,
    cpu_infer: int | None,
    planning_only: bool = False,
) -> PlacementPlan:
    """Place every module of ``model``; raise KTConfigError with every problem at once."""
    assigned = _assign(model, rules)
    problems: list[str] = []
    refusals: list[str] = []
    hits = {id(rule): 0 for rule in rules.rules}
    for rule in assigned.values():
        if rule is not None:
            hits[id(rule)] += 1
    for rule in rules.rules:
        # an included rule may be overridden on purpose by the including file: only the file's own
        # rules must match something
        if hits[id(rule)] == 0 and rule.source == rules.source:
            problems.append(f"{rule.where}: {rule.describe()} matches no module of this model")
    notes = []
    lacking = missing_devices(rules, cuda_device_count())
    if planning_only:
        notes += [f"not on this machine: {m}" for m in lacking]
    else:
        problems += lacking
    default_device, note = (torch.device("cpu"), None) if lacking else resolve_device(rules.default_device)
    notes += [note] if note else []

    experts = []
    expert_names = set()
    for name, module in find_routed_experts(model, family):
        expert_names.add(name)
        rule = assigned[name]
        where = rule.where if rule is not None else rules.default_where
        device = rule.device if rule is not None else rules.default_device
        layer = layer_index(name)
        if device != "cpu":
            refusals.append(
                f"{where}: routed experts {name} placed on {device!r}; this version of kt-ft computes routed "
                "experts on 'cpu' only (keep some of them on the GPU with `gpu_experts`, or stream them with `stream`)"
            )
        num = module.gate_up_proj.shape[0]
        spec = rule.gpu_experts.for_layer(layer) if rule is not None and rule.gpu_experts else None
        gpu_bad: list[str] = []
        if spec is not None and (spec.ids or spec.count):
            gpu_bad = _gpu_problems(rule, name, spec, num)
            problems += gpu_bad
        else:
            spec = None
        stream = rule.stream.for_layer(layer) if rule is not None and rule.stream else None
        if stream is not None and (stream.is_all or stream.ids or stream.count):
            if not gpu_bad:
                problems += _stream_problems(rule, name, spec, stream, num)
        else:
            stream = None
        backend = kt_backend if kt_backend != "auto" else (rule.backend if rule and rule.backend else "auto")
        threads = rule.threads if rule is not None and rule.threads is not None else cpu_infer
        placement = rule.placement if rule is not None else "manual"
        experts.append(
            ExpertPlacement(
                name,
                layer,
                device,
                backend,
                threads,
                rule,
                spec,
                expert_spec(family, module),
                stream,
                placement=placement,
            )
        )

    module_devices = {}
    reported: set[int] = set()
    for name, rule in assigned.items():
        module_devices[name] = rule.device if rule is not None else rules.default_device
        if rule is None or id(rule) in reported or name in expert_names:
            continue
        if any(name.startswith(f"{e}.") for e in expert_names):
            continue
        differs = rule.device != rules.default_device
        if differs and not planning_only and not lacking:  # e.g. cpu vs cuda on a CPU-only machine
            differs = resolve_device(rule.device)[0] != default_device
        if differs:
            refusals.append(
                f"{rule.where}: module {name} placed on {rule.device!r}; this version of kt-ft runs every "
                f"non-expert module on the training device ({rules.default_device!r}); multi-device "
                "placement of non-expert modules is not implemented yet"
            )
            reported.add(id(rule))
    if not experts:
        problems.append(
            f"{rules.source}: no routed-experts module ({family.experts_class}) found in the model"
        )
    if not planning_only:
        problems += refusals
    if problems:
        raise KTConfigError(problems)
    return PlacementPlan(rules.source, experts, default_device, notes, refusals, module_devices)
