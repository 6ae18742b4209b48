"""kt-ft's one entry point, free of any training framework: ``apply(model, KTConfig) -> KTRun``.

The flow: rule (a file or a built-in name; default: the model family's) -> placement plan (which
module goes where) -> ``placement: auto`` layers get their split under the GPU memory cap -> the
routed experts are replaced by ``KTExperts`` with their expert LoRA -> a re-planner for the auto
layers. The LLaMA-Factory integration (``kt_ft/integrations/llamafactory``), ``kt-ft bench`` and a plain
transformers / PEFT script all call this; what they add is their own glue (arguments, adapter
files, checkpoint hooks, data parallelism).

A plain training loop, or the HF Trainer, with kt-ft::

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(...))
    run = kt_ft.apply(model, kt_ft.KTConfig(rank=8, alpha=16, cutoff_len=2048))
    ...  # train; after each optimizer step: run.step(global_step)
    # or an HF Trainer: kt_trainer_class(Trainer)(model=model, ..., callbacks=[KTCallback()]).train()
    # (kt_ft.integrations.trainer: checkpoint manifests, placement: auto's steps, resume)

The expert LoRA parameters are ordinary ``nn.Parameter``s of the model (``run.expert_lora()``),
so any optimizer that takes ``model.parameters()`` trains them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kt_ft.backends import lm_loss
from kt_ft.backends.lora_linear import install_fused_lora
from kt_ft.backends.rms_norm import install_fused_rms_norm
from kt_ft.backends.rotary import install_fused_rotary
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.base.settings import fusions
from kt_ft.formats.lora_layout import LORA_NAMES
from kt_ft.formats.manifest import KTAdapterInfo, read_manifest
from kt_ft.plan.auto import auto_layers
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.family import family_of
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import PlacementPlan, make_plan
from kt_ft.plan.recipe import KTConfig
from kt_ft.plan.report import train_sizes
from kt_ft.runtime.adapter import (
    adapter_info,
    hook_load_adapter,
    hook_save_pretrained,
    kt_expert_modules,
    load_kt_adapter_experts,
)
from kt_ft.runtime.dispatch import register_experts_function
from kt_ft.runtime.distributed import setup_data_parallel
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.patch import KTSummary, replace_routed_experts
from kt_ft.runtime.replan import Replanner, auto_at_start

logger = get_logger(__name__)


@dataclass
class KTRun:
    """What ``apply`` did to a model: its plan, the experts summary, the rule, and for
    ``placement: auto`` the context (``auto``) and the re-planner that keeps the split up to date."""

    model: torch.nn.Module
    plan: PlacementPlan
    summary: KTSummary
    rule_path: Path
    auto: Any = None  # runtime.replan.AutoContext, or None without auto layers
    replanner: Any = None  # runtime.replan.Replanner, or None
    info: KTAdapterInfo | None = None  # what an adapter of this run is for (its manifest)

    def step(self, global_step: int) -> bool:
        """Call after each optimizer step: ``placement: auto`` calibrates and re-plans here;
        returns True when the split changed."""
        return self.replanner.step(global_step) if self.replanner is not None else False

    def expert_lora(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of every expert-LoRA tensor the run added."""

        for name, m in self.model.named_modules():
            if isinstance(m, KTExperts):
                for n, p in zip(LORA_NAMES, m.lora_tensors(), strict=True):
                    yield f"{name}.{n}", p


def resolve_rule(rule: str | Path | None, family) -> Path:
    """The rule file ``rule`` names (a path or a built-in), default ``family``'s built-in."""
    name = str(rule) if rule else family.builtin_rule
    path = resolve_rule_path(name)
    if path is None:
        raise KTConfigError(f"kt_optimize_rule={name!r}: no such file or built-in rule")
    return path


def plan_for(model: torch.nn.Module, config: KTConfig) -> tuple[PlacementPlan, Path]:
    """The placement plan of ``model`` under ``config``'s rule (its notes logged); nothing changes yet."""
    family = family_of(model.config)
    path = resolve_rule(config.rule, family)
    plan = make_plan(model, load_rules(path), family, config.backend, config.threads)
    for note in plan.notes:
        logger.info(note)
    return plan, path


def apply(
    model: torch.nn.Module,
    config: KTConfig,
    *,
    plan: PlacementPlan | None = None,
    planned_auto: Any = None,
    trainable: bool = True,
) -> KTRun:
    """Every change kt-ft makes to ``model`` (a transformers model, PEFT-wrapped or not), in order:
    plan the placement of ``config``'s rule, give ``placement: auto`` layers their split, replace
    the routed experts by ``KTExperts`` with their expert LoRA, install the chunked loss and the
    fused LoRA linears, RMSNorm and rotary embedding, load ``config.adapter``'s expert LoRA,
    freeze it unless ``config.experts_trainable``, set up data parallelism when this process is
    one of several, and hook ``save_pretrained`` / ``load_adapter`` so adapters are written and
    read with their expert LoRA and manifest.

    ``plan``: one made earlier by ``plan_for`` (the caller needed it first, e.g. to share expert
    weights between processes); ``planned_auto``: the context of a ``placement: auto`` split the
    caller already wrote into ``plan`` (the bench plans for a model deeper than the one it runs).
    ``trainable`` False (inference): no re-planner, no data parallelism, and with an adapter its
    manifest, not ``config``, says the expert LoRA's rank and alpha."""
    config = config.validate()
    if config.adapter is not None and not trainable:
        lora = read_manifest(config.adapter)["lora"]
        config = replace(config, rank=lora["rank"], alpha=lora["alpha"], use_rslora=lora["use_rslora"])
    register_experts_function()  # "kt_ft" in transformers' ALL_EXPERTS_FUNCTIONS (runtime/dispatch.py)
    if plan is None:
        plan, rule_path = plan_for(model, config)
    else:
        rule_path = resolve_rule(config.rule, family_of(model.config))
    auto = planned_auto if planned_auto is not None else _auto_placement(model, plan, config)
    summary = replace_routed_experts(
        model,
        plan,
        config.rank,
        config.scaling,
        config.chunk_size,
        seed=config.seed,
        lora_dtype=config.lora_dtype or torch.float32,
    )
    _install_chunked_loss(model)
    replanner = None
    if auto is not None and trainable:
        # replan_steps 0: no re-planning from routing counts, only the one check of the CPU op's
        # rate after a few steps (``Replanner.calibrate``)
        replanner = Replanner(auto, config.replan_steps, config.replan_threshold)
    info = adapter_info(
        model,
        base_model=config.base_model,
        rank=config.rank,
        alpha=config.alpha,
        use_rslora=config.use_rslora,
        summary=summary,
        plan=plan,
        rule_path=rule_path,
    )
    model._kt_ft_info = info  # the trainer callback and the save hook read it
    experts_trainable = trainable and config.experts_trainable
    if config.adapter is not None:
        # a PEFT caller (LLaMA-Factory) has loaded, and for inference merged, PEFT's own part already
        load_kt_adapter_experts(model, config.adapter, info, trainable=experts_trainable)
        logger.info(f"loaded expert LoRA from {config.adapter} (manifest, sizes and sha256 checked)")
    if not experts_trainable:
        if trainable:
            logger.info("the expert LoRA stays frozen (experts_trainable=False)")
        for m in kt_expert_modules(model):
            for p in m.lora_tensors():
                p.requires_grad_(False)
    if trainable:
        setup_data_parallel(model)  # several processes: DDP setup and expert-LoRA grad averaging
    hook_save_pretrained(model, info)
    hook_load_adapter(model, info, experts_trainable)
    install_fused_lora(model)  # PEFT's LoRA linears as one autograd node each (KT_FT_FUSIONS: lora)
    install_fused_rms_norm(model)  # RMSNorm through torch's rms_norm (KT_FT_FUSIONS: norm)
    install_fused_rotary(model)  # q and k's rotary embedding as one autograd node (KT_FT_FUSIONS: rope)
    _log_summary(model, summary, rule_path)
    run = KTRun(model, plan, summary, rule_path, auto, replanner, info)
    model._kt_ft_run = run  # the HF Trainer callback (kt_ft.integrations.trainer) steps it
    return run


def _install_chunked_loss(model: torch.nn.Module) -> None:
    if "loss" not in fusions():
        return
    why_not = lm_loss.install(model)
    if why_not is None:
        logger.info(
            "training loss: lm_head and cross entropy a chunk of tokens at a time, no [tokens, vocab] "
            "logits (KT_FT_FUSIONS without loss: the model's own)"
        )
    else:
        logger.info(f"training loss: the model's own ({why_not})")


def _log_summary(model: torch.nn.Module, summary: KTSummary, rule_path: Path) -> None:
    """One line saying what went where (and the process's RSS), and the GPU memory allocated."""
    experts = {id(p) for m in kt_expert_modules(model) for p in m.parameters()}
    other = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in experts)
    logger.info(
        f"{summary.line()}; {rule_path.name} from {rule_path.parent}; non-expert weights {fmt_bytes(other)} "
        f"go to {summary.default_device}; process RSS {fmt_bytes(_rss_bytes())}"
    )
    if torch.cuda.is_available():
        logger.info(f"GPU memory allocated now: {fmt_bytes(torch.cuda.memory_allocated())}")


def _rss_bytes() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("nan")


def _auto_placement(model: torch.nn.Module, plan: PlacementPlan, config: KTConfig):
    """``placement: auto`` layers of the plan get their split now (``placement/runtime.py``);
    returns the context a re-planner needs, or None when the rule has no auto layer."""

    if not auto_layers(plan):
        return None

    started = auto_at_start(
        model,
        plan,
        train_sizes(config),
        gpu_memory_gib=config.gpu_memory_gib,
        remeasure=config.remeasure,
        chunk_size=config.chunk_size,
    )
    return None if started is None else started[0]
