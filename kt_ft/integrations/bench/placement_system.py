"""The kt-ft side of one placement system inside a bench worker (``step.py``): the rule it
writes, the planner's split and prediction; and the routed experts' GPU budget under a cap of the
full model. Used by the step worker and by the placement driver (``placement.py``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from kt_ft.backends.registry import select_backend
from kt_ft.formats.skeleton import meta_model
from kt_ft.integrations.bench.models import LORA_RANK, MODEL_CONFIGS
from kt_ft.plan.auto import layer_shape, predict_plan
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.family import family_of, unwrap_peft
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.plan.report import TrainSizes, estimate
from kt_ft.runtime.measure import device_rates_on_cpu, machine_rates
from kt_ft.runtime.replan import auto_at_start

PLACEMENTS = ("cpu", "auto", "stream")


class Placement:
    """The kt-ft side of one placement system, inside a bench worker process."""

    def __init__(
        self, kind: str, preset: str, cap_gib: float, threads: int, backend: str, budget: int | None = None
    ):
        self.kind, self.preset, self.cap_gib = kind, preset, cap_gib
        self.threads, self.backend, self.budget = threads, backend, budget
        self.predicted_s: float | None = None
        self.ctx = None  # placement: auto's context (``placement/runtime.py``), for the run's re-plans
        self._tmp = tempfile.TemporaryDirectory(prefix="kt-ft-placement-")

    def rule_file(self, family) -> Path:
        """The family's rule, its experts rule overridden for this placement."""

        base = resolve_rule_path(family.builtin_rule)
        action = {"cpu": "", "auto": ", placement: auto", "stream": ", stream: all"}[self.kind]
        classes = ", ".join(family.experts_classes)
        path = Path(self._tmp.name) / f"{self.kind}.yaml"
        path.write_text(
            f"- match: {{class: [{classes}]}}\n  replace: {{device: cpu{action}}}\n- include: {base}\n"
        )
        return path

    def apply(self, model, plan, seq: int) -> str:
        """Plan (auto) and predict; returns a note for the record."""
        first = plan.experts[0]
        dtype = unwrap_peft(model.get_submodule(first.name)).gate_up_proj.dtype
        shape = layer_shape(model, first, dtype)
        cuda = torch.cuda.is_available()
        name = select_backend(self.backend, dtype, first.spec)[0].name
        rates = machine_rates(shape, name, self.threads, seq, LORA_RANK, cuda=cuda)
        if not cuda:
            rates = device_rates_on_cpu(rates, shape, seq, LORA_RANK)
        sizes = TrainSizes(seq, 1, LORA_RANK)
        if self.kind == "auto":
            real = MODEL_CONFIGS[self.preset][1]["num_hidden_layers"]
            scale = real / model.config.get_text_config().num_hidden_layers
            self.ctx, choice = auto_at_start(
                model, plan, sizes, rates=rates, expert_budget_bytes=self.budget, layer_scale=scale
            )
            self.predicted_s = choice.prediction.step_s
            return f"resident/streamed/CPU {split_text(choice, shape.num_experts)}"
        self.predicted_s = predict_plan(model, plan, dtype=dtype, sizes=sizes, rates=rates).step_s
        return f"every expert {'streamed' if self.kind == 'stream' else 'on the CPU'}"


def split_text(choice, num_experts: int) -> str:
    """'L0 128/0/0, L1 7/112/9, ...': resident/streamed/CPU experts per layer of a planner choice."""
    counts = [s.counts(num_experts) for s in choice.splits]
    return ", ".join(f"L{layer} {r}/{s}/{c}" for layer, (r, s, c) in zip(choice.layers, counts))


def expert_budget(preset: str, cap_gib: float, seq: int) -> int:
    """The routed experts' GPU budget under ``cap_gib`` for the full model."""
    from transformers import AutoConfig  # why: transformers only where a budget is computed

    model_type, cfg = MODEL_CONFIGS[preset]
    config = AutoConfig.for_model(model_type, **cfg)
    family = family_of(config)
    model = meta_model(config, torch.bfloat16)
    plan = make_plan(
        model, load_rules(resolve_rule_path(family.builtin_rule)), family, "auto", 1, planning_only=True
    )
    est = estimate(model, plan, torch.bfloat16, TrainSizes(seq, 1, LORA_RANK))
    rest = est["devices"].get("cuda:0", {}).get("total_bytes", 0)
    return int(cap_gib * 2**30 - rest)
