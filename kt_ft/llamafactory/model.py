"""Attach kt-ft to a model LLaMA-Factory has loaded and wrapped with PEFT."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.fused import FUSED_FILE, load_fused_expert_lora, save_fused_expert_lora
from ..errors import KTConfigError
from ..log import get_logger
from ..models import family_of
from ..moe.patch import replace_routed_experts
from ..rules import load_rules, make_plan, resolve_rule_path

logger = get_logger(__name__)


def _rss_gib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """Same scaling as PEFT's LoRA: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def attach_kt(model: Any, model_args: Any, finetuning_args: Any, is_trainable: bool) -> None:
    """Replace routed experts by kt-ft's CPU experts (with expert LoRA) and hook saving."""
    family = family_of(model.config)
    rule_name = model_args.kt_optimize_rule or family.builtin_rule
    rule_path = resolve_rule_path(rule_name)
    if rule_path is None:
        raise KTConfigError(f"kt_optimize_rule={rule_name!r}: no such file or built-in rule")
    plan = make_plan(model, load_rules(rule_path), family, model_args.kt_backend, model_args.cpu_infer)
    for note in plan.notes:
        logger.info(note)

    rank = finetuning_args.lora_rank
    alpha = finetuning_args.lora_alpha if finetuning_args.lora_alpha is not None else rank * 2
    summary = replace_routed_experts(
        model, plan, rank, lora_scaling(rank, alpha, finetuning_args.use_rslora), model_args.chunk_size
    )

    adapters = model_args.adapter_name_or_path or []
    if adapters:
        src = adapters[-1]
        if not (Path(src) / FUSED_FILE).is_file():
            raise KTConfigError(
                f"{Path(src) / FUSED_FILE}: missing; adapter_name_or_path={src!r} has no kt-ft expert LoRA "
                "(was it trained with use_kt: true?)"
            )
        load_fused_expert_lora(model, src)
        logger.info(f"loaded expert LoRA from {Path(src) / FUSED_FILE}")

    if not is_trainable:
        for m in model.modules():
            if hasattr(m, "runner"):
                for p in m.lora_tensors():
                    p.requires_grad_(False)

    _save_fused_with_adapter(model)
    gpu_bytes = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if not _is_routed_expert_param(n, model)
    )
    logger.info(
        f"{summary.line()}; {rule_path.name} from {rule_path.parent}; non-expert weights {gpu_bytes / 2**30:.2f} GiB "
        f"go to {summary.default_device}; process RSS {_rss_gib():.2f} GiB"
    )
    if torch.cuda.is_available():
        logger.info(f"GPU memory allocated now: {torch.cuda.memory_allocated() / 2**30:.2f} GiB")


def _is_routed_expert_param(name: str, model: Any) -> bool:
    module_name = name.rpartition(".")[0]
    try:
        return hasattr(model.get_submodule(module_name), "runner")
    except AttributeError:
        return False


def _save_fused_with_adapter(model: Any) -> None:
    """Make ``model.save_pretrained`` (what the Trainer calls for every checkpoint and the final
    output) also write fused_expert_lora.safetensors into the same directory."""
    original = model.save_pretrained
    if getattr(original, "_kt_ft", False):
        return

    @functools.wraps(original)
    def save_pretrained(save_directory, *args, **kwargs):
        result = original(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            save_fused_expert_lora(model, save_directory)
        return result

    save_pretrained._kt_ft = True
    model.save_pretrained = save_pretrained
