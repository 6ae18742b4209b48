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
    # or: Trainer(model=model, ..., callbacks=[run.trainer_callback()]).train()

The expert LoRA parameters are ordinary ``nn.Parameter``s of the model (``run.expert_lora()``),
so any optimizer that takes ``model.parameters()`` trains them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kt_ft.backends import lm_loss
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.base.settings import enabled
from kt_ft.formats.lora_layout import LORA_NAMES, lora_scaling
from kt_ft.plan.auto import auto_layers
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.family import family_of
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import PlacementPlan, make_plan
from kt_ft.plan.report import TrainSizes, state_bytes
from kt_ft.runtime.dispatch import register_experts_function
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.patch import KTSummary, replace_routed_experts
from kt_ft.runtime.replan import Replanner, auto_at_start

logger = get_logger(__name__)


@dataclass
class KTConfig:
    """What ``apply`` needs; the LLaMA-Factory keys of the same meaning in brackets.

    rule: optimize-rule file or built-in name [kt_optimize_rule]; None: the family's built-in.
    rank, alpha, use_rslora: the expert LoRA [lora_rank, lora_alpha, use_rslora].
    backend: CPU expert kernel [kt_backend]; threads: its CPU threads in this process [cpu_infer].
    chunk_size: max tokens per CPU expert call [chunk_size].
    gpu_memory_gib: ``placement: auto``'s cap on the training GPU [kt_gpu_memory]; None: its free memory.
    cutoff_len, batch: tokens per micro-batch, for ``placement: auto`` [cutoff_len,
    per_device_train_batch_size]. replan_steps, replan_threshold, remeasure: [kt_replan_*, kt_remeasure].
    seed: expert-LoRA init (None: torch's global generator).
    lora_dtype: the expert LoRA's parameters (float32; bfloat16 under [pure_bf16], which keeps every
    trainable parameter bf16, its grads and AdamW moments with it)."""

    rule: str | Path | None = None
    rank: int = 8
    alpha: float = 16
    use_rslora: bool = False
    backend: str = "auto"
    threads: int | None = None
    chunk_size: int = 8192
    gpu_memory_gib: float | None = None
    cutoff_len: int = 2048
    batch: int = 1
    replan_steps: int = 0
    replan_threshold: float = 0.1
    remeasure: bool = False
    seed: int | None = None
    lora_dtype: torch.dtype = torch.float32

    @property
    def scaling(self) -> float:
        return lora_scaling(rank=self.rank, alpha=self.alpha, use_rslora=self.use_rslora)


@dataclass
class KTRun:
    """What ``apply`` did to a model: its plan, the experts summary, the rule, and for
    ``placement: auto`` the context (``auto``) and the re-planner that keeps the split up to date."""

    model: torch.nn.Module
    plan: PlacementPlan
    summary: KTSummary
    rule_path: Path
    auto: Any = None  # placement.runtime.AutoContext, or None without auto layers
    replanner: Any = None  # placement.runtime.Replanner, or None

    def step(self, global_step: int) -> bool:
        """Call after each optimizer step: ``placement: auto`` calibrates and re-plans here;
        returns True when the split changed."""
        return self.replanner.step(global_step) if self.replanner is not None else False

    def trainer_callback(self):
        """A ``transformers.TrainerCallback`` that calls ``step`` after each optimizer step of an HF
        ``Trainer`` (``Trainer(..., callbacks=[run.trainer_callback()])``)."""
        from transformers import TrainerCallback  # why: only an HF Trainer run needs it

        run = self

        class KTRunCallback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                run.step(state.global_step)

        return KTRunCallback()

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
    """Plan, place and replace the routed experts of ``model`` (a transformers model, PEFT-wrapped
    or not) following ``config``; ``plan``: one made earlier by ``plan_for`` (the caller needed it
    first, e.g. to share expert weights between processes); ``planned_auto``: the context of a
    ``placement: auto`` split the caller already wrote into ``plan`` (the bench plans for a model
    deeper than the one it runs). ``trainable`` False: no re-planner."""
    register_experts_function()  # "kt_ft" in transformers' ALL_EXPERTS_FUNCTIONS (models/dispatch.py)
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
        lora_dtype=config.lora_dtype,
    )
    if enabled("KT_FT_CHUNKED_LOSS"):
        why_not = lm_loss.install(model)
        if why_not is None:
            logger.info(
                "training loss: lm_head and cross entropy a chunk of tokens at a time, no [tokens, vocab] "
                "logits (KT_FT_CHUNKED_LOSS=0: the model's own)"
            )
        else:
            logger.info(f"training loss: the model's own ({why_not})")
    replanner = None
    if auto is not None and trainable:
        # replan_steps 0: no re-planning from routing counts, only the one check of the CPU op's
        # rate after a few steps (``Replanner.calibrate``)
        replanner = Replanner(auto, config.replan_steps, config.replan_threshold)
    return KTRun(model, plan, summary, rule_path, auto, replanner)


def _auto_placement(model: torch.nn.Module, plan: PlacementPlan, config: KTConfig):
    """``placement: auto`` layers of the plan get their split now (``placement/runtime.py``);
    returns the context a re-planner needs, or None when the rule has no auto layer."""

    if not auto_layers(plan):
        return None

    started = auto_at_start(
        model,
        plan,
        TrainSizes(
            config.cutoff_len, config.batch, config.rank, state_bytes(config.lora_dtype == torch.bfloat16)
        ),
        gpu_memory_gib=config.gpu_memory_gib,
        remeasure=config.remeasure,
        chunk_size=config.chunk_size,
    )
    return None if started is None else started[0]
