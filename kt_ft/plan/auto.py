"""``placement: auto``: the planner's split written into a PlacementPlan, and the report of it.

Inputs are what ``kt-ft rules plan`` has before any weight is read (a meta model, the plan, the
dtype, the training sizes) or what a run has at start (the loaded model): the MoE layers' shapes
come from the experts modules, the non-expert FLOPs from the model's linear layers and config,
and the GPU memory the routed experts may take is the cap minus ``rules/report.py``'s estimate
of everything else on the training GPU (non-expert weights, LoRA and optimizer, activations,
and the experts that manual rules keep there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kt_ft.backends.quant_weights import is_quantized
from kt_ft.base.log import fmt_bytes
from kt_ft.plan.cost import LayerShape, LayerSplit, Prediction, Rates, non_expert_flops, predict
from kt_ft.plan.homes import lora_home, pick_resident_ids, pick_stream_ids
from kt_ft.plan.placement import ExpertPlacement, PlacementPlan
from kt_ft.plan.report import TrainSizes, _expert_dims, _ranges, estimate
from kt_ft.plan.schema import GpuExpertSpec
from kt_ft.plan.splits import Choice, PlannerInput, choose_splits


def auto_layers(plan: PlacementPlan) -> list[ExpertPlacement]:
    return [e for e in plan.experts if e.placement == "auto"]


def layer_shape(model: torch.nn.Module, e: ExpertPlacement, dtype: torch.dtype) -> LayerShape:
    num, hidden, inter = _expert_dims(model, e)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    top_k = int(getattr(text, "num_experts_per_tok", 1))
    nbytes = torch.empty((), dtype=dtype).element_size()
    # routed experts kept quantized (kt_ft.backends.quant): their stored bytes are what the GPU holds and the
    # link carries
    mod = model.get_submodule(e.name)
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    stored = (gu.nbytes() + dn.nbytes()) // num if is_quantized(gu) and is_quantized(dn) else None
    return LayerShape(num, hidden, inter, top_k, nbytes, 2 if nbytes <= 2 else 4, stored)


def model_non_expert_flops(model: torch.nn.Module, plan: PlacementPlan, sizes: TrainSizes) -> float:
    """``cost.non_expert_flops`` of the model: its ``nn.Linear`` weights outside the routed experts
    (``lm_head`` apart), causal attention of every decoder layer (heads x head_dim from the config)."""
    experts = tuple(f"{e.name}." for e in plan.experts)
    linear = head = 0
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or name.startswith(experts):
            continue
        if name.endswith("lm_head"):
            head += m.weight.numel()
        else:
            linear += m.weight.numel()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(text, "num_attention_heads", 1)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return non_expert_flops(
        linear, head, text.num_hidden_layers, heads, head_dim, sizes.cutoff_len, sizes.batch
    )


def _resident_ids(e: ExpertPlacement, num: int, popularity: Sequence[float] | None) -> tuple[int, ...]:
    spec = e.gpu_experts
    if spec is None:
        return ()
    pop = None if popularity is None else torch.tensor(list(popularity), dtype=torch.float64)
    return pick_resident_ids(num, spec.ids, spec.count, pop)


def current_splits(
    model: torch.nn.Module, plan: PlacementPlan, popularity: dict[int, Sequence[float]] | None = None
) -> list[LayerSplit]:
    """Each MoE layer's split as the plan says it (a count takes the most popular / first ids; a
    stream count the next ones after the resident)."""
    out = []
    for e in plan.experts:
        num = _expert_dims(model, e)[0]
        pop = (popularity or {}).get(e.layer)
        res = _resident_ids(e, num, pop)
        st: tuple[int, ...] = ()
        if e.stream_experts is not None:  # ids, a count, or ``all`` (both None): the run's own pick
            se = e.stream_experts
            pop_t = None if pop is None else torch.tensor(list(pop), dtype=torch.float64)
            st = pick_stream_ids(num, res, se.ids, se.count, pop_t)
        out.append(LayerSplit(res, st))
    return out


def predict_plan(
    model: torch.nn.Module,
    plan: PlacementPlan,
    *,  # the rest by name (sizes, rates, caps: easy to swap)
    dtype: torch.dtype,
    sizes: TrainSizes,
    rates: Rates,
    popularity: dict[int, Sequence[float]] | None = None,
    graphs: bool = False,
) -> Prediction:
    """The cost model's prediction for every MoE layer of the plan as it stands. ``graphs``: whether
    all-resident layers replay CUDA graphs (``cost.predict``; a run asks ``moe.graphed.expected``)."""
    shapes = [layer_shape(model, e, dtype) for e in plan.experts]
    pops = [(popularity or {}).get(e.layer) for e in plan.experts]
    splits = current_splits(model, plan, popularity)
    tokens = sizes.cutoff_len * sizes.batch
    flops = model_non_expert_flops(model, plan, sizes)
    # layers whose planner left their expert LoRA on the CPU beside GPU experts pay for it
    lora_on_cpu = [e.lora_on_gpu is False for e in plan.experts]
    return predict(
        shapes, splits, rates, sizes.lora_rank, tokens, flops, pops, lora_on_cpu=lora_on_cpu, graphs=graphs
    )


def training_device_key(plan: PlacementPlan) -> str:
    d = plan.module_devices.get("", "cuda")
    return "cuda:0" if d == "cuda" else d


def plan_auto(
    model: torch.nn.Module,
    plan: PlacementPlan,
    *,  # the rest by name (sizes, rates, caps: easy to swap)
    dtype: torch.dtype,
    sizes: TrainSizes,
    rates: Rates,
    cap_bytes: int | None,
    popularity: dict[int, Sequence[float]] | None = None,
    allow_stream: bool | None = None,
    expert_budget_bytes: int | None = None,
    layer_scale: float = 1.0,
    lora_on_gpu: dict[int, bool] | None = None,
    training_device: torch.device | None = None,
    cuda_overhead_bytes: int | None = None,
    reserve_bytes: int = 0,
) -> Choice | None:
    """Choose and write ``gpu_experts`` / ``stream_experts`` (ids) of every ``placement: auto`` layer.

    ``cap_bytes``: GPU memory the whole run may take on the training device (None: nothing on the
    GPU); ``expert_budget_bytes`` instead gives the auto-placed experts' share directly (the bench:
    the full model's share, with ``layer_scale`` = real layers / benchmarked layers, see
    ``choose_splits``). ``lora_on_gpu``: layer -> whether its expert LoRA already lives on the
    GPU (a re-plan: it stays where it is whatever the new split); None: it will follow the split.
    ``training_device``: the device of the run being planned, which decides where the expert LoRA
    of layers with GPU experts lives (``lora_home``); None: the plan's, as resolved on this
    machine (``kt-ft rules plan`` for a GPU machine from a CPU-only one passes the rules' device).
    ``cuda_overhead_bytes``: the training GPU's memory outside PyTorch's allocator, as a run
    measured it (None: ``rules/report.py``'s estimate). ``reserve_bytes``: GPU bytes held back
    beyond the estimate (a run's measurement of its non-expert work, ``runtime.py``).
    Returns the planner's choice (None: no auto layer)."""
    autos = auto_layers(plan)
    if not autos:
        return None
    for e in autos:
        e.gpu_experts = e.stream_experts = None
    base = (
        estimate(model, plan, dtype, sizes, cuda_overhead_bytes)["devices"]
        .get(training_device_key(plan), {})
        .get("total_bytes", 0)
    ) + reserve_bytes
    budget = (
        expert_budget_bytes
        if expert_budget_bytes is not None
        else None
        if cap_bytes is None
        else cap_bytes - base
    )
    inputs = [
        PlannerInput(e.layer, layer_shape(model, e, dtype), (popularity or {}).get(e.layer)) for e in autos
    ]
    stream = True if allow_stream is None else allow_stream
    device = plan.default_device if training_device is None else training_device
    choice = choose_splits(
        inputs,
        rates,
        rank=sizes.lora_rank,
        tokens=sizes.cutoff_len * sizes.batch,
        budget_bytes=budget,
        allow_stream=stream,
        nonexpert_flops=model_non_expert_flops(model, plan, sizes),
        layer_scale=layer_scale,
        # layers with GPU experts keep their expert LoRA + AdamW state there (16 bytes a parameter,
        # 8 under pure_bf16)
        lora_state_bytes=sizes.state_bytes if lora_home(device, True) is not None else 0,
        lora_fixed=None if lora_on_gpu is None else [lora_on_gpu.get(e.layer, False) for e in autos],
    )
    for e, split in zip(autos, choice.splits, strict=True):
        e.gpu_experts = GpuExpertSpec(None, split.resident, None) if split.resident else None
        e.stream_experts = GpuExpertSpec(None, split.streamed, None) if split.streamed else None
        if lora_on_gpu is None:  # the first plan decides where the LoRA lives; a re-plan keeps it
            e.lora_on_gpu = False if choice.lora_on_gpu is False else None
    if cap_bytes is not None and expert_budget_bytes is None:
        choice.notes.insert(
            0,
            f"GPU cap {fmt_bytes(cap_bytes)} - {fmt_bytes(base)} for everything but the auto-placed experts "
            f"= {fmt_bytes(max(budget, 0))} for them",
        )
    return choice


def placement_section(
    model: torch.nn.Module,
    plan: PlacementPlan,
    *,  # the rest by name (sizes, rates, caps: easy to swap)
    dtype: torch.dtype,
    sizes: TrainSizes,
    rates: Rates,
    choice: Choice | None,
    rate_lines: list[str],
    graphs: bool = False,
) -> dict:
    """The ``placement`` block of ``kt-ft rules plan`` (JSON-ready): per layer group the resident /
    streamed / CPU counts, the predicted seconds per resource and step, the bottleneck. ``graphs``:
    as ``predict_plan``'s."""
    pred = predict_plan(model, plan, dtype=dtype, sizes=sizes, rates=rates, graphs=graphs)
    splits = current_splits(model, plan)
    groups: list[dict] = []
    for e, s, t in zip(plan.experts, splits, pred.layers, strict=True):
        num = _expert_dims(model, e)[0]
        r, st, c = s.counts(num)
        key = (e.placement, r, st, c)
        if groups and groups[-1]["key"] == key:
            groups[-1]["layers"].append(e.layer)
            # gpu_s: the layer's experts and its share of the non-expert work (cost.py: phases)
            for k, v in (("cpu_s", t.cpu_s), ("link_s", t.link_s), ("gpu_s", t.gpu_s + t.nonexpert_s),
                         ("step_s", t.seconds)):  # fmt: skip
                groups[-1][k] += v
        else:
            groups.append(
                {"key": key, "layers": [e.layer], "cpu_s": t.cpu_s, "link_s": t.link_s,
                 "gpu_s": t.gpu_s + t.nonexpert_s, "step_s": t.seconds}
            )  # fmt: skip
    out_groups = []
    for g in groups:
        placement, r, st, c = g.pop("key")
        out_groups.append(
            {
                "layers": _ranges(g.pop("layers")),
                "placement": placement,
                "resident": r,
                "streamed": st,
                "cpu": c,
                **g,
            }
        )
    totals = pred.totals()
    tokens = sizes.cutoff_len * sizes.batch
    return {
        "rates": rate_lines,
        "rates_raw": {
            "cpu_flops": rates.cpu_flops,
            "link_bytes_s": rates.link_bytes_s,
            "gpu_flops": rates.gpu_flops,
            "gpu_expert_flops": rates.gpu_expert_flops,
        },
        "budget_bytes": None if choice is None else choice.budget_bytes,
        "groups": out_groups,
        "predicted": {
            "step_s": pred.step_s,
            "tokens_per_s": tokens / pred.step_s if pred.step_s > 0 else None,
            "cpu_busy_s": totals["cpu"],
            "link_busy_s": totals["link"],
            "gpu_busy_s": totals["gpu"],
            "nonexpert_gpu_s": pred.nonexpert_s,
            "bottleneck": pred.bottleneck,
            "resident_bytes": pred.resident_bytes,
            "stream_buffer_bytes": pred.stream_buffer_bytes,
            "expert_activation_bytes": pred.expert_activation_bytes,
        },
        "notes": [] if choice is None else list(choice.notes),
    }


def format_placement(section: dict) -> str:
    """The human lines of the ``placement`` block."""
    p = section["predicted"]
    lines = ["", "  placement (cost model, kt_ft/plan/cost.py); rates:"]
    lines += [f"    {line}" for line in section["rates"]]
    lines += ["", f"  {'layers':<12}{'placement':<11}{'resident':>9}{'streamed':>9}{'cpu':>6}"
              f"{'cpu ms':>10}{'link ms':>10}{'gpu ms':>10}{'step ms':>10}   (summed over the group's layers; gpu: "
              "experts + the layers' share of the non-expert work)"]  # fmt: skip
    for g in section["groups"]:
        lines.append(
            f"  {g['layers']:<12}{g['placement']:<11}{g['resident']:>9}{g['streamed']:>9}{g['cpu']:>6}"
            + "".join(f"{g[k] * 1e3:>10.3f}" for k in ("cpu_s", "link_s", "gpu_s", "step_s"))
        )
    tok = f", {p['tokens_per_s']:,.0f} tokens/s" if p["tokens_per_s"] else ""
    lines += [
        f"  predicted step {p['step_s'] * 1e3:.3f} ms{tok}: busy CPU {p['cpu_busy_s'] * 1e3:.3f} ms, link "
        f"{p['link_busy_s'] * 1e3:.3f} ms, GPU {p['gpu_busy_s'] * 1e3:.3f} ms (non-expert "
        f"{p['nonexpert_gpu_s'] * 1e3:.3f} ms); bottleneck: {p['bottleneck']}",
        f"  experts on the GPU: resident {fmt_bytes(p['resident_bytes'])}, stream buffers "
        f"{fmt_bytes(p['stream_buffer_bytes'])}, their activations {fmt_bytes(p['expert_activation_bytes'])}",
    ]
    lines += [f"  note: {n}" for n in section["notes"]]
    return "\n".join(lines)
