"""``placement: auto`` in a run: the split chosen at start, and re-planned when routing drifts.

At start (``auto_at_start``, from ``kt_ft/integrations/llamafactory/model.py`` before the experts are
replaced): the machine's rates (``measure.machine_rates``: cache or a few seconds of
measurement), the micro-batch (cutoff_len x per_device_train_batch_size), and the GPU memory
cap (``kt_gpu_memory``, default: what this process holds plus the GPU's free memory) go to the
planner; its split is written into the plan's ``gpu_experts`` / ``stream_experts`` (ids), which
``moe/patch.py`` then builds. Routing popularity is unknown at start: uniform.

Re-planning (``Replanner``, every ``kt_replan_steps`` optimizer steps, from the trainer
callback): each ``KTExperts`` counts its routed pairs per expert on the router's device (a
scatter-add, no host sync); at a check the counts since the last check are read (one sync), and
when some layer's distribution moved by more than ``kt_replan_threshold`` (total variation
distance) from the one the current split was planned with, the planner runs again with the
counts and each layer's resident and streamed experts are re-assigned
(``KTExperts.set_placement``, between two steps).

Calibration (``Replanner.calibrate``, in every ``placement: auto`` run, ``kt_replan_steps`` or
not): the CPU op's time and pairs from the end of step 1 to the end of step ``CALIBRATE_AFTER``
give its rate in this run; off by more than ``CALIBRATE_TOLERANCE`` from the rate the split was
planned with, it replaces it and the planner runs again (also at later re-plan checks, at most
``MAX_CALIBRATIONS`` times a run).

Trial (``Replanner`` after the first calibration): when the split still has CPU experts in layers
whose other experts run on the GPU, the same budget with every expert the GPU can take (the CPU
as last resort) is tried for a few steps, each split's step time measured, and the faster kept
(``TRIAL_STEPS``). Why measured and not predicted: on the GPU machine a 4-layer Qwen3-30B-A3B
step with 7 of 128 experts a layer on the CPU took 220 ms against 121 ms with all of them
streamed, where the model predicted the opposite (the CPU op's per-call work and the host time
around it are not proportional to its pairs). The cost model now adds the CPU op's time to a
layer's instead of hiding it under the link (``cost.py``), so it plans such splits only where
the CPU is the cheaper home; the trial stays as the measured check.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kt_ft.backends.registry import select_backend
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.base.processes import topology
from kt_ft.plan.auto import (
    auto_layers,
    format_placement,
    layer_shape,
    placement_section,
    plan_auto,
    predict_plan,
)
from kt_ft.plan.cost import LayerShape, Rates
from kt_ft.plan.family import unwrap_peft
from kt_ft.plan.placement import PlacementPlan
from kt_ft.plan.report import CUDA_GROWTH_BYTES, TrainSizes, non_expert_activation_bytes
from kt_ft.plan.splits import Choice
from kt_ft.runtime.backend_pick import pick_for
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.graphed import expected as graphs_expected
from kt_ft.runtime.graphed import forbid as forbid_graphs
from kt_ft.runtime.measure import cpu_rate_key, describe, machine_rates, remember_cpu_flops
from kt_ft.runtime.non_expert import measure_non_expert as run_non_expert

logger = get_logger(__name__)
GIB = 2**30


def default_cap_bytes(device: torch.device) -> int:
    """GPU memory this run may use: what this process already holds (its CUDA runtime and its
    allocator's memory) plus what is free."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) + cuda_overhead_now(device))


def cuda_overhead_now(device: torch.device) -> int:
    """The device memory in use outside PyTorch's allocator (the CUDA context, library handles; on a
    shared GPU other processes too), as the driver reports it: total - free - reserved."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total - free - torch.cuda.memory_reserved(device)))


# under kt_gpu_memory, room the plan leaves inside the allocator's limit: with the limit at the
# plan's total, DeepSeek-V2-Lite runs at 12 and 24 GiB failed their second step with ~0.9 GiB
# reserved but unallocated (fragments) and an 800 MiB block (the loss's fp32 logits) to place
ALLOCATOR_SLACK_BYTES = 512 * 2**20


def use_expandable_segments() -> str:
    """Ask PyTorch's CUDA allocator for expandable segments (new blocks map into growable
    segments instead of fixed ones, so freed memory is not stranded in fragments), unless
    ``PYTORCH_CUDA_ALLOC_CONF`` already says; returns what holds, for the log."""
    import os

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in conf:
        return f"as PYTORCH_CUDA_ALLOC_CONF={conf!r} says"
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return "not available in this torch"
    try:
        setter("expandable_segments:True")
    except RuntimeError as e:  # e.g. a platform without virtual memory management
        return f"refused ({str(e).splitlines()[0]})"
    return "on for new blocks"


def limit_allocator(device: torch.device, cap_bytes: int, overhead_bytes: int) -> int:
    """Hold PyTorch's caching allocator on ``device`` to ``cap_bytes - overhead_bytes`` of reserved
    memory (``torch.cuda.set_per_process_memory_fraction``): on reaching it the allocator frees
    its cached blocks and retries before it fails, so fragmentation and cached blocks never take
    the process past the cap the driver sees. Returns the allocator's limit in bytes."""
    device = torch.device(device)
    # a bare "cuda" is the current device; the fraction wants an index
    index = device.index if device.index is not None else torch.cuda.current_device()
    _, total = torch.cuda.mem_get_info(index)
    limit = max(0, cap_bytes - overhead_bytes)
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), index)
    return limit


@dataclass
class AutoContext:
    """What a (re-)plan needs, kept from the start of the run."""

    model: torch.nn.Module
    plan: PlacementPlan
    dtype: torch.dtype
    sizes: TrainSizes
    rates: Rates
    cap_bytes: int | None
    expert_budget_bytes: int | None = None  # the bench's budget for the experts (instead of cap_bytes)
    layer_scale: float = 1.0
    cuda_overhead_bytes: int | None = None  # measured at start + CUDA_GROWTH_BYTES (None: estimated)
    # (cuda, cache slot) of the CPU rate when it came from this machine's cache / measurement: a
    # calibration keeps the run's rate there (``measure.remember_cpu_flops``); None: given rates
    cpu_cache: tuple[bool, str] | None = None
    # GPU bytes held back from the experts beyond the estimate: what the run measured the non-expert
    # work to take over what the plan counted for it (``Replanner.measure_non_expert``)
    reserve_bytes: int = 0


def auto_at_start(
    model: torch.nn.Module,
    plan: PlacementPlan,
    sizes: TrainSizes,
    gpu_memory_gib: float | None = None,
    remeasure: bool = False,
    rates: Rates | None = None,
    expert_budget_bytes: int | None = None,
    layer_scale: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[AutoContext, Choice] | None:
    """Plan every ``placement: auto`` layer of ``plan`` (None: there is none). ``rates``: injected
    (tests); else measured / cached for this machine, for the CPU backend the run will use: with
    ``chunk_size`` (the run's), ``kt_backend: auto`` is the one ``moe/backend_pick.py`` times
    fastest, as ``replace_routed_experts`` will pick it from the same cache slots."""
    autos = auto_layers(plan)
    if not autos:
        return None

    first = autos[0]
    dtype = unwrap_peft(model.get_submodule(first.name)).gate_up_proj.dtype
    shape = layer_shape(model, first, dtype)
    device = plan.default_device
    cuda = device.type == "cuda"
    tokens = sizes.cutoff_len * sizes.batch
    cpu_cache = None
    if rates is None:
        if chunk_size is None:
            backend = select_backend(first.backend, dtype, first.spec)[0].name
        else:
            # as ``replace_routed_experts`` will pick it (the same call: the same cache slots)
            backend = pick_for(model, first, chunk_size)[0].name
        rates = machine_rates(
            shape, backend, first.threads or 1, tokens, sizes.lora_rank, remeasure, cuda=cuda
        )
        cpu_cache = (cuda, cpu_rate_key(shape, backend, first.threads or 1, tokens))
    cap = context = overhead = None
    if gpu_memory_gib is not None:
        cap = int(gpu_memory_gib * GIB)
    elif cuda:
        cap = default_cap_bytes(device)
    if cuda and expert_budget_bytes is None:
        # the cap is what the driver reports: the CUDA runtime outside PyTorch's allocator counts;
        # under a cap the plan also leaves the allocator room for fragmentation
        context = cuda_overhead_now(device)
        slack = ALLOCATOR_SLACK_BYTES if gpu_memory_gib is not None else 0
        overhead = context + CUDA_GROWTH_BYTES + slack
    if context is not None and gpu_memory_gib is not None:
        # the CUDA graphs' memory pool of resident layers is not in the plan: none under a cap (said
        # before planning: the cost model predicts graphed layers otherwise)
        forbid_graphs(f"kt_gpu_memory={gpu_memory_gib:g}: their memory pool is not in the plan")
    choice = plan_auto(
        model,
        plan,
        dtype=dtype,
        sizes=sizes,
        rates=rates,
        cap_bytes=cap,
        expert_budget_bytes=expert_budget_bytes,
        layer_scale=layer_scale,
        cuda_overhead_bytes=overhead,
    )
    if context is not None and gpu_memory_gib is not None:
        limit = limit_allocator(device, cap, context + CUDA_GROWTH_BYTES)
        expandable = use_expandable_segments()
        logger.info(
            f"kt_gpu_memory={gpu_memory_gib:g}: {fmt_bytes(context)} of {device} in use outside PyTorch's allocator "
            f"now (CUDA context) + {fmt_bytes(CUDA_GROWTH_BYTES)} kept for kernels loaded later: the allocator is held "
            f"to {fmt_bytes(limit)} (torch.cuda.set_per_process_memory_fraction), of which the plan leaves "
            f"{fmt_bytes(ALLOCATOR_SLACK_BYTES)} free for fragmentation; expandable segments: {expandable}"
        )
    section = placement_section(
        model,
        plan,
        dtype=dtype,
        sizes=sizes,
        rates=rates,
        choice=choice,
        rate_lines=describe(rates, shape, sizes.lora_rank),
        graphs=graphs_expected(dtype),
    )
    logger.info(
        f"placement: auto for {len(autos)} MoE layers, {tokens} tokens a micro-batch:"
        + format_placement(section)
    )
    return AutoContext(
        model, plan, dtype, sizes, rates, cap, expert_budget_bytes, layer_scale, overhead, cpu_cache
    ), choice


def tv_distance(p: Sequence[float], q: Sequence[float]) -> float:
    """Total variation distance of two count vectors, each normalised (an all-zero one: uniform)."""

    def norm(v):
        s = float(sum(v))
        return [float(x) / s for x in v] if s > 0 else [1.0 / len(v)] * len(v)

    a, b = norm(p), norm(q)
    return 0.5 * sum(abs(x - y) for x, y in zip(a, b, strict=True))


CALIBRATE_AFTER = 3  # optimizer steps before the first calibration (the first: warm-up, not counted)
CALIBRATE_TOLERANCE = 1.25  # re-plan when the CPU op's rate in the run is off by more than this factor
MAX_CALIBRATIONS = 2  # CPU rate replacements per run (its rate differs with the CPU's share: no ping-pong)
TRIAL_STEPS = 2  # timed steps per split in the trial, each after one settling step (new buffers, pinning)
TRIAL_MARGIN = 0.03  # the GPU-only split is kept when its step is faster by more than this fraction
# CPU rate factor that makes the planner put experts on the CPU only where nothing else fits
CPU_LAST_RESORT = 1e-6


@dataclass
class _Trial:
    """The measured comparison of two splits: ``splits[0]`` the planner's, ``splits[1]`` the
    GPU-only one; per split, the step times after its settling step."""

    splits: list[dict[int, tuple]]  # per candidate: layer -> (gpu_experts, stream_experts) rule specs
    choices: list[Choice | None]
    times: list[list[float]] = dataclasses.field(default_factory=lambda: [[], []])
    current: int = 0
    settle: bool = True  # the next step after a switch is not timed


class Replanner:
    """Re-plans the resident experts of the auto layers when routing drifts, and once the CPU op's
    rate in this run is known (module doc)."""

    def __init__(self, ctx: AutoContext, every: int, threshold: float) -> None:
        self.ctx, self.every, self.threshold = ctx, every, threshold
        self.modules = self._modules()
        self.planned_with: dict[int, list[float]] = {}  # layer -> counts of the current split (none: uniform)
        self.replans = 0
        self.calibrations = 0
        self.last_choice: Choice | None = None  # the latest re-plan's choice
        self.cpu_last_resort = False  # the trial found the GPU-only split faster: plan so from now on
        self.trial_note: str | None = None  # what the trial measured (logged; the bench prints it)
        self._trial: _Trial | None = None
        self._t_last: float | None = None  # perf_counter at the last ``step`` call
        self._applied = self._specs()  # layer -> the (gpu_experts, stream_experts) its module runs
        # (seconds in the CPU op, pairs, their FLOPs) at the start of calibrate's window
        self._cpu_mark: tuple[float, int, float] | None = None
        # without link / GPU rates every expert stays on the CPU whatever the counts: count nothing
        self.active = ctx.rates.has_gpu
        self._update_counting()

    def _update_counting(self) -> None:
        """Keep routing counts only where a re-plan reads them (4 kernels a layer and pass, host
        time a host-bound step pays): re-planning active, and some auto layer with experts not
        resident -- with every expert of every auto layer resident no re-plan can move one."""
        movable = any(
            m.resident is None or len(m.resident.ids) < m.num_experts for m in self.modules.values()
        )
        for m in self.modules.values():
            m.count_routing = self.active and self.every > 0 and movable

    def _modules(self) -> dict[int, torch.nn.Module]:

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

    def _cpu_totals(self) -> tuple[float, int, float]:
        """(seconds in the CPU op, pairs it computed, their FLOPs) summed over the auto layers."""
        busy, pairs, flops = 0.0, 0, 0.0
        for m in self.modules.values():
            r = m.runner
            busy += r.busy_s
            pairs += r.pairs_done
            flops += r.pairs_done * LayerShape(m.num_experts, m.hidden_dim, m.intermediate_dim, 1).pair_flops(
                self.ctx.sizes.lora_rank
            )
        return busy, pairs, flops

    def calibrate(self) -> bool:
        """Compare the CPU op's rate since the last mark (``mark_cpu``) with the rate the split was
        planned with; when off by more than ``CALIBRATE_TOLERANCE`` either way, plan again with the
        run's own rate (at most ``MAX_CALIBRATIONS`` times). Returns True when the split changed.

        Why: the planner's CPU rate is a few seconds' measurement of the op alone; inside a step
        the op ran 1.25-1.5x slower on the GPU machine (a 4-layer Qwen3-30B-A3B step with 9-10 CPU
        experts a layer: 60 ms a layer measured, 41 predicted), enough to leave experts on the CPU
        in layers where streaming them was faster."""
        if self._cpu_mark is None or self.calibrations >= MAX_CALIBRATIONS or not self.active:
            self.mark_cpu()
            return False
        busy0, pairs0, flops0 = self._cpu_mark
        busy, pairs, flops = self._cpu_totals()
        self.mark_cpu()
        rates = self.ctx.rates
        if pairs - pairs0 <= 0 or busy - busy0 <= 0 or not rates.cpu_flops:
            return False  # no CPU pairs since the mark: nothing to learn
        in_run = (flops - flops0) / (busy - busy0)
        ratio = in_run / rates.cpu_flops
        if 1 / CALIBRATE_TOLERANCE <= ratio <= CALIBRATE_TOLERANCE:
            return False
        self.calibrations += 1
        self.ctx.rates = dataclasses.replace(
            rates, cpu_flops=in_run, source={**rates.source, "cpu_flops": "this run"}
        )
        kept = ""
        if self.ctx.cpu_cache is not None:  # the next run on this machine starts from it
            remember_cpu_flops(*self.ctx.cpu_cache, in_run)
            kept = " (kept in the rates cache for later runs)"
        logger.info(
            f"placement: auto: the CPU op ran at {in_run / 1e12:.3g} TFLOP/s in this run, "
            f"{ratio:.2f}x the {rates.cpu_flops / 1e12:.3g} planned with: planning again with it{kept}"
        )
        return self.replan(dict(self.planned_with), reason="the CPU op's rate in this run")

    def measure_non_expert(
        self, model: torch.nn.Module, autocast_dtype: torch.dtype | None = None
    ) -> float | None:
        """Before the first step: time the model's non-expert work on one micro-batch
        (``non_expert.py``), keep it in the rates (every later prediction uses it) and log the
        step predicted with it. ``model``: the model the trainer runs (PEFT-wrapped or not).
        Returns the seconds, or None where nothing was measured (no GPU, several processes: a
        forward + backward outside the data-parallel wrapper would start its gradient sync)."""
        ctx = self.ctx
        if not self.active or topology().distributed:
            return None
        device = model.get_input_embeddings().weight.device
        if device.type != "cuda":
            return None
        graphs = graphs_expected(ctx.dtype)
        before = predict_plan(
            ctx.model, ctx.plan, dtype=ctx.dtype, sizes=ctx.sizes, rates=ctx.rates, graphs=graphs
        )
        run = run_non_expert(
            model,
            seq_len=ctx.sizes.cutoff_len,
            batch=ctx.sizes.batch,
            device=device,
            autocast_dtype=autocast_dtype,
            gpu_time=any(t.graphed for t in before.layers),  # then the GPU's share of it matters too
        )
        s = run.seconds
        source = {**ctx.rates.source, "nonexpert_s": "this run"}
        if run.gpu_seconds is not None:
            source["nonexpert_gpu_s"] = "this run"
        ctx.rates = dataclasses.replace(
            ctx.rates, nonexpert_s=s, nonexpert_gpu_s=run.gpu_seconds, source=source
        )
        pred = predict_plan(
            ctx.model, ctx.plan, dtype=ctx.dtype, sizes=ctx.sizes, rates=ctx.rates, graphs=graphs
        )
        tokens = ctx.sizes.cutoff_len * ctx.sizes.batch
        gpu = (
            f"; the GPU busy {run.gpu_seconds * 1e3:.1f} ms of it, which the CUDA graphs' expert work "
            "of resident layers joins while the host queues the rest"
            if run.gpu_seconds is not None
            else ""
        )
        logger.info(
            f"placement: auto: the non-expert work of a micro-batch (forward + backward, routed experts "
            f"skipped) took {s * 1e3:.1f} ms in this run (its FLOPs at the GPU's matmul rate said "
            f"{before.nonexpert_s * 1e3:.1f} ms{gpu}): predicted step {pred.step_s * 1e3:.3f} ms, "
            f"{tokens / pred.step_s:,.0f} tokens/s ({(pred.step_s - s) * 1e3:.1f} ms beyond the non-expert work's)"
        )
        if run.peak_bytes is not None:
            self._reserve_measured_memory(run.peak_bytes)
        return s

    def _reserve_measured_memory(self, peak_bytes: int) -> None:
        """The GPU memory the non-expert work of a micro-batch took in this run (``peak_bytes``, the
        allocator's rise) against what the plan counted for it (``non_expert_activation_bytes``):
        where the run took more, the difference is held back from the experts (``AutoContext.
        reserve_bytes``) and, under a cap, the split is planned again (before the first step: the
        experts move now, not after an out-of-memory error)."""
        ctx = self.ctx
        elt = torch.empty((), dtype=ctx.dtype).element_size()
        planned = non_expert_activation_bytes(ctx.model, ctx.sizes, elt)
        extra = peak_bytes - planned
        logger.info(
            f"placement: auto: the non-expert work of a micro-batch took {fmt_bytes(peak_bytes)} of GPU "
            f"memory in this run (planned {fmt_bytes(planned)})"
            + (f": {fmt_bytes(extra)} more is held back from the experts" if extra > 0 else "")
        )
        if extra <= 0:
            return
        ctx.reserve_bytes = extra
        if ctx.cap_bytes is not None and ctx.expert_budget_bytes is None:
            self.replan({}, reason="the non-expert memory measured in this run")

    def mark_cpu(self) -> None:
        """Start a new window for ``calibrate``."""
        self._cpu_mark = self._cpu_totals()

    @property
    def trying(self) -> bool:
        """A trial is under way: the split may still change (the bench keeps warming up)."""
        return self._trial is not None

    def step(self, global_step: int) -> bool:
        """Called after each optimizer step; returns True when the split changed."""
        now = time.perf_counter()
        step_s = now - self._t_last if self._t_last is not None else None
        self._t_last = now
        if self._trial is not None:
            return self._trial_step(step_s)
        if self.active and global_step == 1:
            self.mark_cpu()  # the first step warms up (allocations, page faults): not counted
        if self.active and global_step == CALIBRATE_AFTER:
            changed = self.calibrate()
            self._start_trial()  # the split it tries first is the one running now
            return changed
        if not self.active or self.every <= 0 or global_step % self.every:
            return False
        if global_step > CALIBRATE_AFTER and self.calibrate():
            return True
        counts = self.take_counts()
        if not counts:
            return False
        drift = max(
            tv_distance(c, self.planned_with.get(layer, [1.0] * len(c))) for layer, c in counts.items()
        )
        if drift <= self.threshold:
            return False
        return self.replan(counts, drift)

    def _planning_rates(self, cpu_last_resort: bool | None = None) -> Rates:
        rates = self.ctx.rates
        last = self.cpu_last_resort if cpu_last_resort is None else cpu_last_resort
        if last and rates.cpu_flops:
            return dataclasses.replace(rates, cpu_flops=rates.cpu_flops * CPU_LAST_RESORT)
        return rates

    def _specs(self) -> dict[int, tuple]:
        return {e.layer: (e.gpu_experts, e.stream_experts) for e in auto_layers(self.ctx.plan)}

    def _apply(self, specs: dict[int, tuple]) -> int:
        """Write ``specs`` (layer -> (gpu_experts, stream_experts)) into the plan and move the
        layers whose split differs from the one they run (``_applied``); returns how many moved."""
        changed = 0
        for e in auto_layers(self.ctx.plan):
            if e.layer not in specs:
                continue
            e.gpu_experts, e.stream_experts = specs[e.layer]
            m = self.modules.get(e.layer)
            if m is None or self._applied.get(e.layer) == specs[e.layer]:
                continue
            resident = e.gpu_experts.ids if e.gpu_experts is not None else ()
            streamed = e.stream_experts.ids if e.stream_experts is not None else ()
            m.set_placement(resident, streamed)
            self._applied[e.layer] = specs[e.layer]
            changed += 1
        if changed:
            self._update_counting()
        return changed

    def _mixed_layers(self) -> int:
        """Layers with experts both on the CPU and on the GPU under the current split."""
        n = 0
        for e in auto_layers(self.ctx.plan):
            m = self.modules.get(e.layer)
            on_gpu = sum(len(s.ids) for s in (e.gpu_experts, e.stream_experts) if s is not None)
            if m is not None and 0 < on_gpu < m.num_experts:
                n += 1
        return n

    def _start_trial(self) -> None:
        """Begin the trial (module doc) when the split mixes CPU and GPU experts in a layer and the
        GPU-only split differs; nothing moves before the running split has been timed."""
        if not self.active or self.cpu_last_resort or not self._mixed_layers():
            return
        ours = dict(self._applied)
        ours_choice = self.last_choice
        alt_choice = self._plan(dict(self.planned_with), cpu_last_resort=True)
        alt = self._specs()
        self._apply(ours)  # _plan wrote the alternative into the plan: ours again until it is tried
        if alt != ours:
            self._trial = _Trial([ours, alt], [ours_choice, alt_choice])

    def _trial_step(self, step_s: float | None) -> bool:
        """One step of the trial (``step_s``: the step just finished, under the current candidate);
        returns True when the split changed."""
        tr = self._trial
        assert tr is not None
        if tr.settle:
            tr.settle = False
        elif step_s is not None:
            tr.times[tr.current].append(step_s)
        if len(tr.times[tr.current]) < TRIAL_STEPS:
            return False
        if tr.current == 0:  # the planner's split measured: now the GPU-only one
            tr.current, tr.settle = 1, True
            return self._apply(tr.splits[1]) > 0
        ours, alt = (min(t) for t in tr.times)
        keep = 1 if alt < ours * (1 - TRIAL_MARGIN) else 0
        self._trial = None
        kept = "the GPU-only split" if keep else "the planner's split"
        self.trial_note = (
            f"measured the planner's split {ours * 1e3:.0f} ms a step, every expert the GPU can take "
            f"{alt * 1e3:.0f} ms: kept {kept}"
        )
        logger.info(f"placement: auto: {self.trial_note}")
        if keep:
            self.cpu_last_resort = True
            self.last_choice = tr.choices[1]
            return False  # already in place
        self.last_choice = tr.choices[0]
        return self._apply(tr.splits[0]) > 0

    def _plan(self, counts: dict[int, list[float]], cpu_last_resort: bool | None = None) -> Choice | None:
        """Run the planner (it writes the plan's specs; nothing moves)."""
        ctx = self.ctx
        return plan_auto(
            ctx.model,
            ctx.plan,
            dtype=ctx.dtype,
            sizes=ctx.sizes,
            rates=self._planning_rates(cpu_last_resort),
            cap_bytes=ctx.cap_bytes,
            popularity=counts,
            expert_budget_bytes=ctx.expert_budget_bytes,
            layer_scale=ctx.layer_scale,
            cuda_overhead_bytes=ctx.cuda_overhead_bytes,
            reserve_bytes=ctx.reserve_bytes,
            # the expert LoRA stays where the run put it (``moe/patch.py``): count what is on the GPU
            lora_on_gpu={layer: m.lora_on_device for layer, m in self.modules.items()},
        )

    def replan(
        self, counts: dict[int, list[float]], drift: float = float("nan"), reason: str | None = None
    ) -> bool:
        """Plan again with ``counts`` as popularity (a layer without: uniform) and move each layer's
        resident and streamed experts."""
        self.last_choice = self._plan(counts)
        changed = self._apply(self._specs())
        self.planned_with.update(counts)
        self.replans += 1
        why = reason or f"routing counts (largest drift {drift:.3f} > {self.threshold})"
        logger.info(
            f"placement: auto re-planned from {why}: resident / streamed experts changed on {changed} layers"
        )
        return changed > 0
