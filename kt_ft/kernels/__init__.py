"""CPU expert compute backends and how one is chosen.

``reference`` is the ground truth (a loop over experts under autograd); ``torch`` is the
portable grouped backend; ``kt-kernel`` runs kt-kernel's AMX/AVX512-BF16 SFT kernel where
the CPU and the installed kt-kernel build have it.
"""

from __future__ import annotations

import torch

from ..errors import KTConfigError
from .base import LORA_NAMES, ExpertBackend, ExpertWeights, LoraTensors
from .grouped import GroupedTorchBackend
from .kt_kernel_backend import KTKernelBackend
from .reference import ReferenceBackend, reference_moe

BACKENDS: dict[str, type[ExpertBackend]] = {
    cls.name: cls for cls in (GroupedTorchBackend, ReferenceBackend, KTKernelBackend)
}
# `auto` tries these in order and takes the first that can run here.
AUTO_ORDER = ("kt-kernel", "torch")


def select_backend(name: str, dtype: torch.dtype | None = None) -> tuple[ExpertBackend, str]:
    """Return (backend instance, why it was chosen). ``name`` is a key of BACKENDS or ``auto``;
    ``dtype`` is the expert weights' dtype (some backends run bf16 only)."""
    if name == "auto":
        skipped = []
        for candidate in AUTO_ORDER:
            reason = BACKENDS[candidate].unavailable_reason(dtype)
            if reason is None:
                return BACKENDS[candidate](), f"auto: {candidate} is the fastest backend that runs here"
            skipped.append(f"{candidate}: {reason}")
        raise KTConfigError("kt_backend=auto found no usable backend: " + "; ".join(skipped))
    if name not in BACKENDS:
        raise KTConfigError(f"kt_backend={name!r} is unknown; valid choices: auto, {', '.join(BACKENDS)}")
    reason = BACKENDS[name].unavailable_reason(dtype)
    if reason is not None:
        raise KTConfigError(f"kt_backend={name!r} cannot run on this machine: {reason}")
    return BACKENDS[name](), "asked for by name"


__all__ = [
    "BACKENDS",
    "LORA_NAMES",
    "ExpertBackend",
    "ExpertWeights",
    "LoraTensors",
    "reference_moe",
    "select_backend",
]
