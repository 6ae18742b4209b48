"""CPU expert compute backends and how one is chosen.

``reference`` is the ground truth (a loop over experts under autograd); ``torch`` is the
portable grouped backend, ``torch-ep`` the same with experts in parallel threads (not picked by
``auto`` until measured faster); ``native`` is ``torch`` with its frozen-base GEMMs in kt-ft's
own C++ kernels (bf16 weights read in place, fp32 math: for CPUs without native bf16);
``kt-kernel`` runs kt-kernel's AMX/AVX512-BF16 SFT kernel where
the CPU and the installed kt-kernel build have it.
"""

from __future__ import annotations

import torch

from kt_ft.backends.base import ExpertBackend, ExpertSpec, ExpertWeights, LoraTensors
from kt_ft.backends.grouped import GroupedTorchBackend
from kt_ft.backends.grouped_parallel import ExpertParallelTorchBackend
from kt_ft.backends.kt_kernel import KTKernelBackend
from kt_ft.backends.native_backend import NativeBackend
from kt_ft.backends.reference import ReferenceBackend, reference_moe
from kt_ft.base.errors import KTConfigError
from kt_ft.formats.lora_layout import LORA_NAMES

BACKENDS: dict[str, type[ExpertBackend]] = {
    cls.name: cls
    for cls in (
        GroupedTorchBackend,
        ExpertParallelTorchBackend,
        ReferenceBackend,
        KTKernelBackend,
        NativeBackend,
    )
}
# `auto` tries these in order and takes the first that can run here (and does not ask to be
# passed over: ``auto_skip_reason``). native before torch: on CPUs without native bf16, torch's
# bf16 GEMMs are ~1 GFLOP/s (docs/benchmarks.md, the op section).
AUTO_ORDER = ("kt-kernel", "native", "torch")
# backends that compute quantized experts (``kt_ft.backends.quant``): native decodes the stored codes inside its
# GEMMs (a work item's slab at a time), torch and reference dequantize the base a bounded chunk of experts at a
# time (torch: ``experts(lo, hi)``, reference: ``gate_up[e]``); kt-kernel reads bf16 weights in place.
# `auto` takes them in this order.
QUANTIZED_BACKENDS = ("native", "torch", "reference")


def select_backend(
    name: str, dtype: torch.dtype | None = None, spec: ExpertSpec | None = None, quantized: str | None = None
) -> tuple[ExpertBackend, str]:
    """Return (backend instance, why it was chosen). ``name`` is a key of BACKENDS or ``auto``;
    ``dtype`` is the expert weights' dtype (some backends run bf16 only); ``spec`` the experts'
    layout and activation (None: the default silu layout; some backends compute only that);
    ``quantized``: the experts' storage format when kept quantized (only QUANTIZED_BACKENDS)."""
    if quantized is not None:
        if name == "auto":
            why_not = NativeBackend.unavailable_reason(dtype, spec)
            if why_not is None and dtype == torch.bfloat16:
                return NativeBackend(), (
                    f"auto: native, the fastest backend that computes {quantized} experts (its GEMMs decode "
                    "the stored codes a work item's slab at a time, never a whole expert)"
                )
            return GroupedTorchBackend(), (
                f"auto: torch, the fastest backend that computes {quantized} experts here (it dequantizes a "
                f"bounded chunk of experts at a time inside its products); native: {why_not or 'computes bf16 only'}"
            )
        if name not in QUANTIZED_BACKENDS:
            raise KTConfigError(
                f"kt_backend={name!r} cannot compute {quantized} routed experts kept quantized (it reads bf16 "
                f"weights); valid choices for them: auto, {', '.join(QUANTIZED_BACKENDS)} (or `kt-ft dequantize` "
                "the checkpoint to bf16)"
            )
    special = spec is not None and not spec.is_default
    if name == "auto":
        skipped = []
        for candidate in AUTO_ORDER:
            reason = BACKENDS[candidate].unavailable_reason(dtype, spec)
            if reason is None and (skip := BACKENDS[candidate].auto_skip_reason(dtype, spec)) is not None:
                skipped.append(f"{candidate}: {skip}")
                continue
            if reason is None:
                why = (
                    f"auto: {candidate} is the fastest backend that runs here{BACKENDS[candidate].auto_note}"
                )
                # for experts only some backends compute, say why the faster ones were passed over
                return BACKENDS[candidate](), why + (
                    f"; skipped {'; '.join(skipped)}" if special and skipped else ""
                )
            skipped.append(f"{candidate}: {reason}")
        raise KTConfigError("kt_backend=auto found no usable backend: " + "; ".join(skipped))
    if name not in BACKENDS:
        raise KTConfigError(f"kt_backend={name!r} is unknown; valid choices: auto, {', '.join(BACKENDS)}")
    reason = BACKENDS[name].unavailable_reason(dtype, spec)
    if reason is not None:
        where = "for these experts" if special else "on this machine"
        raise KTConfigError(f"kt_backend={name!r} cannot run {where}: {reason}")
    return BACKENDS[name](), "asked for by name"


__all__ = [
    "BACKENDS",
    "LORA_NAMES",
    "ExpertBackend",
    "ExpertSpec",
    "ExpertWeights",
    "LoraTensors",
    "reference_moe",
    "select_backend",
]
