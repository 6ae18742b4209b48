"""Where a layer's experts and their LoRA live, as the plan, the planner and the experts module
all decide it: which experts a ``gpu_experts`` / ``stream`` count selects, and on which device
a layer's expert LoRA lives (``lora_home``). Planning-level (no model, no kernels): the plan and
``rules plan``'s estimate ask the same questions as ``moe/patch.py`` when it builds the experts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kt_ft.base.processes import topology


def pick_resident_ids(
    num_experts: int, ids: Sequence[int] | None, count: int | None, popularity: torch.Tensor | None = None
) -> tuple[int, ...]:
    """The experts a ``gpu_experts`` entry makes resident: ``ids`` as given, or for a ``count`` the
    ``count`` most popular experts when ``popularity`` [E] (routing counts) is known, else the first
    ``count`` ids (0 .. count-1). Ties keep the lower id. Empty: none."""
    if ids is not None:
        return tuple(sorted(ids))
    if not count:
        return ()
    if popularity is None:
        return tuple(range(count))
    order = sorted(range(num_experts), key=lambda e: (-float(popularity[e]), e))
    return tuple(sorted(order[:count]))


def pick_stream_ids(
    num_experts: int,
    resident: Sequence[int],
    ids: Sequence[int] | None,
    count: int | None,
    popularity: torch.Tensor | None = None,
) -> tuple[int, ...]:
    """The experts a ``stream`` entry streams, given the layer's ``resident`` ids: ``ids`` as given;
    for a ``count`` the ``count`` most popular non-resident experts when ``popularity`` [E] is
    known, else the first ``count`` non-resident ids; ``ids`` and ``count`` both None (``stream:
    all``): every non-resident expert. Ties keep the lower id. Raises ValueError when the ids
    overlap the resident ones or there are not ``count`` non-resident experts."""
    rest = [e for e in range(num_experts) if e not in set(resident)]
    if ids is not None:
        both = sorted(set(ids) & set(resident))
        if both:
            raise ValueError(f"expert ids {both} are both resident (gpu_experts) and streamed")
        return tuple(sorted(ids))
    if count is None:
        return tuple(rest)
    if count > len(rest):
        raise ValueError(
            f"stream count {count} > the {len(rest)} experts not resident ({len(resident)} of {num_experts} are)"
        )
    if popularity is not None:
        rest = sorted(rest, key=lambda e: (-float(popularity[e]), e))
    return tuple(sorted(rest[:count]))


def lora_home(
    training_device: torch.device, on_device: bool, *, keep_on_cpu: bool = False
) -> torch.device | None:
    """Where a layer's expert LoRA lives (None: the CPU). The training GPU when some expert of the
    layer is resident or streamed (``on_device``) and this is a single process: the optimizer then
    steps it on the GPU, and only the CPU op's share crosses the link (a pinned host mirror of the
    LoRA and the CPU experts' gradients back: ``experts.py`` ``_LoraToHost``). Kept on the CPU, a
    Qwen3-30B-A3B layer's ~35 MB of fp32 LoRA would cross twice a step for the device experts and
    be stepped by a CPU AdamW (tens of ms a layer on the GPU machine). Cost: the LoRA, its gradient
    and AdamW moments on the GPU (16 bytes a parameter: ~138 MB for that layer), which the planner
    and ``rules plan`` count. All-CPU layers and several processes (expert-LoRA gradients averaged
    over gloo, ``distributed.py``) keep it on the CPU, and so do the layers of a plan whose
    planner found the step faster with it there (``keep_on_cpu``: a tight ``kt_gpu_memory``,
    ``placement/planner.py`` ``choose_splits``)."""
    if not on_device or keep_on_cpu or training_device.type != "cuda":
        return None
    if topology().distributed or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    return training_device
