"""``placement: auto`` in a run: the split chosen at start, and re-planned when routing drifts.

At start (``auto_at_start``, from ``kt_ft/llamafactory/model.py`` before the experts are
replaced): the machine's rates (``measure.machine_rates``: cache or a few seconds of
measurement), the micro-batch (cutoff_len x per_device_train_batch_size), and the GPU memory
cap (``kt_gpu_memory``, default: what this process holds plus the GPU's free memory) go to the
planner; its split is written into the plan's ``gpu_experts`` / ``stream_experts`` (ids), which
``moe/patch.py`` then builds. Routing popularity is unknown at start: uniform.

Re-planning (``Replanner``, every ``kt_replan_steps`` optimizer steps, from the trainer
callback): each ``KTExperts`` counts its routed pairs per expert on the router's device (a
bincount, no host sync); at a check the counts since the last check are read (one sync), and
when some layer's distribution moved by more than ``kt_replan_threshold`` (total variation
distance) from the one the current split was planned with, the planner runs again with the
counts and each layer's resident and streamed experts are re-assigned
(``KTExperts.set_placement``, between two steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..log import get_logger
from ..rules.plan import PlacementPlan
from ..rules.report import TrainSizes
from .auto import auto_layers, format_placement, layer_shape, placement_section, plan_auto
from .cost import Rates
from .measure import describe, machine_rates
from .planner import Choice

logger = get_logger(__name__)
GIB = 2**30


def default_cap_bytes(device: torch.device) -> int:
    """GPU memory this run may use: what this process already holds plus what is free."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


@dataclass
class AutoContext:
    """What a (re-)plan needs, kept from the start of the run."""

    model: torch.nn.Module
    plan: PlacementPlan
    dtype: torch.dtype
    sizes: TrainSizes
    rates: Rates
    cap_bytes: int | None


def auto_at_start(
    model: torch.nn.Module,
    plan: PlacementPlan,
    sizes: TrainSizes,
    gpu_memory_gib: float | None = None,
    remeasure: bool = False,
    rates: Rates | None = None,
    expert_budget_bytes: int | None = None,
    layer_scale: float = 1.0,
) -> tuple[AutoContext, Choice] | None:
    """Plan every ``placement: auto`` layer of ``plan`` (None: there is none). ``rates``: injected
    (tests); else measured / cached for this machine."""
    autos = auto_layers(plan)
    if not autos:
        return None
    from ..kernels import select_backend
    from ..models import unwrap_peft

    first = autos[0]
    dtype = unwrap_peft(model.get_submodule(first.name)).gate_up_proj.dtype
    shape = layer_shape(model, first, dtype)
    device = plan.default_device
    cuda = device.type == "cuda"
    tokens = sizes.cutoff_len * sizes.batch
    if rates is None:
        backend = select_backend(first.backend, dtype, first.spec)[0].name
        rates = machine_rates(
            shape, backend, first.threads or 1, tokens, sizes.lora_rank, remeasure, cuda=cuda
        )
    cap = None
    if gpu_memory_gib is not None:
        cap = int(gpu_memory_gib * GIB)
    elif cuda:
        cap = default_cap_bytes(device)
    choice = plan_auto(
        model,
        plan,
        dtype,
        sizes,
        rates,
        cap,
        expert_budget_bytes=expert_budget_bytes,
        layer_scale=layer_scale,
    )
    section = placement_section(
        model, plan, dtype, sizes, rates, choice, describe(rates, shape, sizes.lora_rank)
    )
    logger.info(
        f"placement: auto for {len(autos)} MoE layers, {tokens} tokens a micro-batch:"
        + format_placement(section)
    )
    return AutoContext(model, plan, dtype, sizes, rates, cap), choice


def tv_distance(p: Sequence[float], q: Sequence[float]) -> float:
    """Total variation distance of two count vectors, each normalised (an all-zero one: uniform)."""

    def norm(v):
        s = float(sum(v))
        return [float(x) / s for x in v] if s > 0 else [1.0 / len(v)] * len(v)

    a, b = norm(p), norm(q)
    return 0.5 * sum(abs(x - y) for x, y in zip(a, b, strict=True))


class Replanner:
    """Re-plans the resident experts of the auto layers when routing drifts (module doc)."""

    def __init__(self, ctx: AutoContext, every: int, threshold: float) -> None:
        self.ctx, self.every, self.threshold = ctx, every, threshold
        self.modules = self._modules()
        self.planned_with: dict[int, list[float]] = {}  # layer -> counts of the current split (none: uniform)
        self.replans = 0
        # without link / GPU rates every expert stays on the CPU whatever the counts: count nothing
        self.active = ctx.rates.has_gpu
        for m in self.modules.values():
            m.count_routing = self.active

    def _modules(self) -> dict[int, torch.nn.Module]:
        from ..moe.experts import KTExperts

        auto = {e.layer for e in auto_layers(self.ctx.plan)}
        return {
            m.layer_idx: m
            for m in self.ctx.model.modules()
            if isinstance(m, KTExperts) and m.layer_idx in auto
        }

    def take_counts(self) -> dict[int, list[float]]:
        """Counts per auto layer since the last call (one host sync for all layers), reset to zero."""
        out = {}
        for layer, m in self.modules.items():
            c = m.routing_counts
            m.routing_counts = None
            if c is not None:
                out[layer] = [float(x) for x in c.cpu().tolist()]
        return out

    def step(self, global_step: int) -> bool:
        """Called after each optimizer step; returns True when the split changed."""
        if not self.active or self.every <= 0 or global_step % self.every:
            return False
        counts = self.take_counts()
        if not counts:
            return False
        drift = max(
            tv_distance(c, self.planned_with.get(layer, [1.0] * len(c))) for layer, c in counts.items()
        )
        if drift <= self.threshold:
            return False
        return self.replan(counts, drift)

    def replan(self, counts: dict[int, list[float]], drift: float = float("nan")) -> bool:
        """Plan again with ``counts`` as popularity and move each layer's resident experts."""
        ctx = self.ctx
        before = {e.layer: (e.gpu_experts, e.stream_experts) for e in auto_layers(ctx.plan)}
        plan_auto(ctx.model, ctx.plan, ctx.dtype, ctx.sizes, ctx.rates, ctx.cap_bytes, popularity=counts)
        changed = 0
        for e in auto_layers(ctx.plan):
            m = self.modules.get(e.layer)
            if m is None or before.get(e.layer) == (e.gpu_experts, e.stream_experts):
                continue
            resident = e.gpu_experts.ids if e.gpu_experts is not None else ()
            streamed = e.stream_experts.ids if e.stream_experts is not None else ()
            m.set_placement(resident, streamed)
            changed += 1
        self.planned_with.update(counts)
        self.replans += 1
        logger.info(
            f"placement: auto re-planned from routing counts (largest drift {drift:.3f} > {self.threshold}): "
            f"resident / streamed experts changed on {changed} layers"
        )
        return changed > 0
