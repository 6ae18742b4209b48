"""CPU expert compute backends and how one is chosen.

``reference`` is the ground truth (a loop over experts under autograd); ``torch`` is the
portable grouped backend; ``kt-kernel`` (kt-kernel's AMX/AVX512-BF16 SFT kernel) is
registered by name so that asking for it gives a clear reason when it cannot run.
"""

from __future__ import annotations

import logging

from ..errors import KTConfigError
from .base import LORA_NAMES, ExpertBackend, ExpertWeights, LoraTensors
from .grouped import GroupedTorchBackend
from .reference import ReferenceBackend, reference_moe

logger = logging.getLogger(__name__)


class KTKernelBackendUnavailable(ExpertBackend):
    """Placeholder entry so `kt_backend: kt-kernel` fails with a reason instead of 'unknown'."""

    name = "kt-kernel"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import kt_kernel  # noqa: F401
        except ImportError:
            return "the kt-kernel package is not installed (pip install 'kt-ft[kt-kernel]')"
        variant = getattr(kt_kernel, "__cpu_variant__", "unknown")
        if variant not in ("amx", "avx512_bf16"):
            return (
                f"kt-kernel loaded its '{variant}' build, which has no BF16 training kernel "
                "(AMXBF16_SFT needs a CPU with AMX or AVX512-BF16)"
            )
        return "kt-ft's kt-kernel backend is not implemented yet in this version"

    def forward(self, *args, **kwargs):  # pragma: no cover - never constructed
        raise NotImplementedError

    def backward(self, *args, **kwargs):  # pragma: no cover - never constructed
        raise NotImplementedError


BACKENDS: dict[str, type[ExpertBackend]] = {
    cls.name: cls for cls in (GroupedTorchBackend, ReferenceBackend, KTKernelBackendUnavailable)
}
# `auto` tries these in order and takes the first that can run here.
AUTO_ORDER = ("kt-kernel", "torch")


def select_backend(name: str) -> tuple[ExpertBackend, str]:
    """Return (backend instance, why it was chosen). ``name`` is a key of BACKENDS or ``auto``."""
    if name == "auto":
        skipped = []
        for candidate in AUTO_ORDER:
            reason = BACKENDS[candidate].unavailable_reason()
            if reason is None:
                return BACKENDS[candidate](), f"auto: {candidate} is the fastest backend that runs here"
            skipped.append(f"{candidate}: {reason}")
        raise KTConfigError("kt_backend=auto found no usable backend: " + "; ".join(skipped))
    if name not in BACKENDS:
        raise KTConfigError(f"kt_backend={name!r} is unknown; valid choices: auto, {', '.join(BACKENDS)}")
    reason = BACKENDS[name].unavailable_reason()
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
