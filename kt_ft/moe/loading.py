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
"""

from __future__ import annotations

import functools

import torch

from ..log import get_logger
from ..rules.plan import PlacementPlan

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
    config, rules, family, kt_backend: str, cpu_infer: int | None, training_device
) -> tuple[KTDeviceMap, PlacementPlan]:
    """Plan on a meta skeleton of ``config`` (raises KTConfigError before any weight is read)."""
    from ..rules import make_plan
    from ..rules.skeleton import meta_model

    plan = make_plan(meta_model(config, torch.bfloat16), rules, family, kt_backend, cpu_infer)
    install_dispatch_guard()
    return device_map_from_plan(plan, training_device), plan
