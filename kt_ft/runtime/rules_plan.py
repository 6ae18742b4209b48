"""``kt-ft rules plan``'s computation: a rule and a model's ``config.json`` -> where every module
goes and what each device holds, on a meta skeleton (no weight is read).

Shared by the CLI (``kt_ft.integrations.cli.main``) and LlamaBoard's plan preview (``kt_ft.integrations.llamafactory.webui``),
so both print the same report and raise the same errors. Torch and the model code load on the
first call, not on import: the CLI answers ``--help`` without them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kt_ft.base.errors import KTConfigError
from kt_ft.plan.recipe import default_cpu_infer


@dataclass(frozen=True)
class PlanRequest:
    """What ``kt-ft rules plan`` takes: the rule, the model directory and the run's sizes."""

    rule: str
    model: str
    gpu_mem: float | None = None
    cpu_mem: float | None = None
    cutoff_len: int = 2048
    batch: int = 1
    lora_rank: int = 8
    pure_bf16: bool = False  # LLaMA-Factory's pure_bf16: bf16 LoRA, grads and AdamW moments
    cpu_infer: int | None = None
    kt_backend: str = "auto"
    rates: str | None = None
    remeasure: bool = False


def rule_and_model(
    rule: str, model_dir: str | None, cpu_infer: int | None, kt_backend: str = "auto", cuda_count=None
):
    """rule file -> RuleSet; with a model dir also its meta skeleton and planning-only plan."""
    from kt_ft.plan.builtin import resolve_rule_path  # why: torch-free, but rules load on use
    from kt_ft.plan.loader import load_rules  # why: torch-free, but rules load on use

    path = resolve_rule_path(rule)
    if path is None:
        from kt_ft.plan.builtin import builtin_rule_names  # why: as above

        raise KTConfigError(
            f"{rule}: no such rule file or built-in rule; built-in rules: {', '.join(builtin_rule_names())}"
        )
    rules = load_rules(path, cuda_count)
    if model_dir is None:
        return rules, None, None, None
    from kt_ft.backends.quant_detect import config_source, detect_format  # why: torch on use only
    from kt_ft.formats.skeleton import checkpoint_dtype, load_config, meta_model  # why: torch on use only
    from kt_ft.plan.family import family_of  # why: torch on use only
    from kt_ft.plan.placement import make_plan  # why: torch on use only

    config = load_config(model_dir)
    family = family_of(config)
    detect_format(config, config_source(model_dir))  # a method kt-ft does not read: refused here
    dtype, _ = checkpoint_dtype(model_dir, config)
    if dtype.itemsize == 1:  # FP8 checkpoints: the rest is dequantized to bf16, the experts stay fp8
        import torch

        dtype = torch.bfloat16
    model = meta_model(config, dtype)
    plan = make_plan(model, rules, family, kt_backend, cpu_infer or default_cpu_infer(), planning_only=True)
    return rules, model, plan, dtype


def default_rule(model_dir: str) -> str:
    """The built-in rule a run of ``model_dir`` takes without ``kt_optimize_rule``: its family's."""
    from kt_ft.formats.skeleton import load_config  # why: torch on use only
    from kt_ft.plan.family import family_of  # why: torch on use only

    return family_of(load_config(model_dir)).builtin_rule


def plan_report(request: PlanRequest) -> dict:
    """The report ``kt-ft rules plan --json`` prints: devices, bytes, budgets (``fits``), and under
    ``placement`` the auto split with its predicted step when the rule has ``placement: auto``."""
    from kt_ft.backends.quant_detect import detect_format  # why: torch on use only
    from kt_ft.plan.auto import auto_layers  # why: torch on use only
    from kt_ft.plan.report import TrainSizes, check_budgets, estimate, state_bytes  # why: torch on use only
    from kt_ft.runtime.measure import parse_overrides  # why: torch on use only

    overrides = parse_overrides(request.rates)
    _, model, plan, dtype = rule_and_model(request.rule, request.model, request.cpu_infer, request.kt_backend)
    sizes = TrainSizes(request.cutoff_len, request.batch, request.lora_rank, state_bytes(request.pure_bf16))
    section = None
    if auto_layers(plan) or overrides or request.remeasure:
        section = _placement(model, plan, dtype, sizes, overrides, request.gpu_mem, request.remeasure)
    from kt_ft.runtime.quant_loading import stored_linear_weights  # why: torch on use only

    # after placement: auto wrote its split into the plan; quantized experts count as stored, and
    # so do the other linear weights a load keeps quantized
    fmt = detect_format(model.config)
    stored = stored_linear_weights(model, request.model, fmt) if fmt is not None else None
    report = estimate(model, plan, dtype, sizes, expert_format=fmt, stored_weights=stored)
    check_budgets(report, request.gpu_mem, request.cpu_mem)
    if section is not None:
        report["placement"] = section
    return report


def format_plan(report: dict, model_dir: str) -> str:
    """``kt-ft rules plan``'s text for ``report``."""
    from kt_ft.plan.auto import format_placement  # why: torch on use only
    from kt_ft.plan.report import format_report  # why: torch on use only

    section = report.get("placement")
    return format_report(report, model_dir) + (format_placement(section) if section else "")


def fits(report: dict) -> bool:
    """Every device within its budget (``kt-ft rules plan`` exits 1 otherwise)."""
    return all(d.get("fits", True) for d in report["devices"].values())


def _placement(model, plan, dtype, sizes, overrides, gpu_mem, remeasure) -> dict:
    """Rates (overrides, the cache, or measured here), the auto split, and the prediction block."""
    import torch

    from kt_ft.backends.registry import select_backend  # why: torch on use only
    from kt_ft.plan.auto import (  # why: torch on use only
        layer_shape,
        placement_section,
        plan_auto,
        training_device_key,
    )
    from kt_ft.runtime.graphed import expected as graphs_expected  # why: torch on use only
    from kt_ft.runtime.measure import describe, machine_rates  # why: torch on use only

    first = plan.experts[0]
    shape = layer_shape(model, first, dtype)
    backend = select_backend(first.backend, torch.bfloat16)[0].name
    rates = machine_rates(
        shape,
        backend,
        first.threads or 1,
        sizes.cutoff_len * sizes.batch,
        sizes.lora_rank,
        remeasure,
        overrides,
    )
    cap = None
    if gpu_mem is not None:
        cap = int(gpu_mem * 2**30)
    elif torch.cuda.is_available():
        cap = torch.cuda.mem_get_info(0)[0]
    elif rates.has_gpu and any(e.placement == "auto" for e in plan.experts):
        raise KTConfigError(
            "placement: auto with GPU rates needs a GPU memory cap here (no CUDA device to read it from): give --gpu-mem GiB"
        )
    # the run planned for trains on the rules' device, also when this machine lacks it (planning a
    # GPU run from a CPU-only one): where it puts the expert LoRA counts against the budget
    choice = plan_auto(
        model,
        plan,
        dtype=dtype,
        sizes=sizes,
        rates=rates,
        cap_bytes=cap,
        training_device=torch.device(training_device_key(plan)),
    )
    return placement_section(
        model,
        plan,
        dtype=dtype,
        sizes=sizes,
        rates=rates,
        choice=choice,
        rate_lines=describe(rates, shape, sizes.lora_rank),
        # as the run will: a kt_gpu_memory cap (--gpu-mem) turns the CUDA graphs off
        graphs=gpu_mem is None and graphs_expected(dtype),
    )
