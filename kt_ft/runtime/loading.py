"""Load a checkpoint with every weight going straight to its planned device.

Without this, LLaMA-Factory loads the whole model onto the training GPU (``device_map={"":
cuda:N}``) and kt-ft moves the routed experts back to the CPU afterwards: a huge MoE would not
fit on the GPU in between. Here the plan is made first, on a meta skeleton of the config (no
weight read; every rule error is raised before loading), and turned into a transformers
``device_map``: each routed-experts module -> ``"cpu"``, everything else (``""``) -> the
training device.

transformers would hand a device map with several devices to accelerate's ``dispatch_model``,
which treats ``"cpu"`` entries as *offloaded*: hooks that copy those weights to the GPU at every
forward, and meta tensors in their place. kt-ft computes those experts on the CPU, so for a
``KTDeviceMap`` the dispatch is skipped: the model gets no hooks and no ``hf_device_map``, and
the HF Trainer sees a plain single-device model (``is_model_parallel`` stays False; its
``model.to(device)`` leaves ``KTExperts`` on the CPU, see ``KTExperts._apply``).

The routed experts themselves are not read by transformers: its loader would hold them twice in
RSS at the peak (the file mapping's pages and the fused copy, see ``expert_reading``). Where kt-ft
can read the checkpoint's expert layout (``expert_files``), the device map puts them on ``meta``
and ``ExpertReader.fill`` reads them into their one CPU copy right after ``from_pretrained``;
otherwise transformers loads them (the reason is logged).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kt_ft.backends.quant_detect import config_source, take_quantization_config
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.formats.expert_files import ParamSource, find_expert_sources
from kt_ft.formats.skeleton import meta_model
from kt_ft.plan.placement import PlacementPlan, make_plan
from kt_ft.runtime.expert_reading import Allocator, fill_routed_experts
from kt_ft.runtime.shared_weights import meta_device_map

logger = get_logger(__name__)


class KTDeviceMap(dict):
    """A transformers device map made by kt-ft (the marker that skips accelerate's dispatch)."""


def device_map_from_plan(plan: PlacementPlan, training_device: torch.device | str | int) -> KTDeviceMap:
    """``{"": training_device, <experts module>: "cpu", ...}`` (transformers matches the longest key)."""
    dm = KTDeviceMap({"": training_device})
    for e in plan.experts:
        dm[e.name] = "cpu"
    return dm


def install_dispatch_guard() -> None:
    """Make transformers skip accelerate's dispatch for a KTDeviceMap (idempotent)."""
    from transformers import modeling_utils

    original = modeling_utils.accelerate_dispatch
    if getattr(original, "_kt_ft", False):
        return

    @functools.wraps(original)
    def accelerate_dispatch(model, hf_quantizer, device_map, *args, **kwargs):
        if isinstance(device_map, KTDeviceMap):
            return None  # weights are already where the plan wants them; no offload hooks
        return original(model, hf_quantizer, device_map, *args, **kwargs)

    accelerate_dispatch._kt_ft = True
    modeling_utils.accelerate_dispatch = accelerate_dispatch


def planned_device_map(
    config, rules, family, kt_backend: str, cpu_infer: int | None, training_device, *, skeleton=None
) -> tuple[KTDeviceMap, PlacementPlan]:
    """Plan on a meta skeleton of ``config`` (``skeleton``: one the caller built already; raises
    KTConfigError before any weight is read)."""
    skeleton = meta_model(config, torch.bfloat16) if skeleton is None else skeleton
    plan = make_plan(skeleton, rules, family, kt_backend, cpu_infer)
    install_dispatch_guard()
    return device_map_from_plan(plan, training_device), plan


@dataclass
class ExpertReader:
    """The routed experts of a checkpoint, to be read by kt-ft instead of transformers."""

    model_dir: Path
    expert_names: list[str]
    sources: list[ParamSource]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sources)

    def device_map(self, device_map: dict) -> dict:
        """``device_map`` with the routed experts on ``meta`` (transformers reads none of them)."""
        return meta_device_map(device_map, self.expert_names)

    def fill(self, model: nn.Module, allocate: Allocator | None = None) -> int:
        """Read the experts into ``model``'s meta parameters (see ``expert_reading``); returns bytes."""
        return fill_routed_experts(model, self.sources, allocate)


def plan_expert_reader(model_dir, config, expert_names: list[str], quant=None):
    """An ExpertReader when ``model_dir`` is a local checkpoint whose expert layout kt-ft reads,
    else None (transformers loads the experts; the reason is logged). ``quant``: the checkpoint's
    quantized format (``kt_ft.backends.quant_detect.take_quantization_config``): a ``QuantizedExpertReader`` then,
    or an error saying why kt-ft cannot read it (transformers would not keep the experts quantized)."""
    if quant is not None:
        from kt_ft.runtime.quant_loading import (  # why: quant.loading imports moe
            QuantizedExpertReader,
            find_plain_expert_tensors,
            find_quantized_sources,
        )

        path = Path(str(model_dir))
        if not path.is_dir():
            raise KTConfigError(
                f"{model_dir}: {quant.name} routed experts are read by kt-ft itself, and it is not a local "
                "directory; give a local checkpoint directory"
            )
        skeleton = meta_model(config, torch.bfloat16)
        sources = find_quantized_sources(path, skeleton, expert_names, quant)
        plain = find_plain_expert_tensors(path, skeleton, expert_names, quant)
        stored = ", ".join(s.name for s in quant.stored(1, 1))
        logger.info(
            f"{model_dir}: {quant.name} checkpoint; transformers loads it as a plain model, so its load report "
            f"lists the quantized tensors ({stored}) as UNEXPECTED and may list the routed experts as MISSING: "
            "kt-ft reads those itself right after it (routed experts kept quantized, the rest dequantized)"
        )
        return QuantizedExpertReader(path, list(expert_names), sources, quant, plain)
    path = Path(str(model_dir))
    if not path.is_dir():
        logger.info(f"{model_dir}: not a local directory; transformers loads the routed experts")
        return None
    sources, reason = find_expert_sources(path, meta_model(config, torch.bfloat16), expert_names)
    if reason:
        logger.warning(f"{reason}; transformers loads the routed experts (peak RSS about two copies of them)")
        return None
    return ExpertReader(path, list(expert_names), sources)


def load_planned(model_dir, device_map: dict, plan: PlacementPlan, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(model_dir, device_map=device_map, **kwargs)`` with
    the routed experts of ``plan`` read by kt-ft where it can (scripts and benchmarks; LLaMA-Factory
    goes through ``kt_ft.integrations.llamafactory.model.plan_loading``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(model_dir)
    # a quantized checkpoint: refused here when kt-ft does not read its method; else transformers
    # gets the config without quantization_config and kt-ft reads the quantized tensors
    quant = take_quantization_config(config, config_source(model_dir))
    reader = plan_expert_reader(model_dir, config, [e.name for e in plan.experts], quant)
    if reader is not None:
        device_map = reader.device_map(device_map)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, device_map=device_map, **kwargs)
    if reader is not None:
        reader.fill(model)
    return model
