"""``kt_backend: auto`` by measurement: each CPU backend that runs here timed on the layer's shape.

A fixed order (``kernels.AUTO_ORDER``) guesses which backend is fastest from what was measured on
other machines: kt-kernel first, kt-ft's native kernels on CPUs without native bf16, torch last.
On a given CPU the order can be wrong (the e2e run on an AMX Xeon had torch at 122 tok/s and
kt-kernel at 285 where the op bench said 1.13x), so for bf16 experts of the default layout
``pick_backend`` times the forward + backward of every backend that runs here
(``placement/measure.py`` ``cached_cpu_flops``: a few real-shaped experts, kt-kernel on the whole
layer) and takes the fastest. The figures are cached per machine, shape and thread count in the
slots the placement planner reads, so a later run (or ``placement: auto`` in this one) does not
time them again. Other dtypes (fp32 test and demo models), quantized experts and other layouts keep
the fixed order: what the measurement builds is a bf16 layer of the default layout.
"""

from __future__ import annotations

import torch

from kt_ft.backends.base import DEFAULT_SPEC, ExpertBackend, ExpertSpec
from kt_ft.backends.registry import BACKENDS, select_backend
from kt_ft.base.log import get_logger
from kt_ft.plan.cost import LayerShape
from kt_ft.plan.family import unwrap_peft
from kt_ft.plan.recipe import physical_cpu_cores
from kt_ft.runtime.measure import cache_path, cached_cpu_flops

logger = get_logger(__name__)

# what ``auto`` times (torch-ep too: the fixed order never picks it, a measurement may)
MEASURED = ("kt-kernel", "native", "torch", "torch-ep")


def timing_shape(model: torch.nn.Module, hf: torch.nn.Module, spec: ExpertSpec) -> LayerShape | None:
    """The shape ``pick_backend`` times for the experts module ``hf`` of ``model``: default layout
    (``gate_up_proj`` [E, 2I, H]) and weights not kept quantized; None otherwise."""
    if not spec.is_default or getattr(hf.gate_up_proj, "fmt", None) is not None:
        return None
    num, two_inter, hidden = hf.gate_up_proj.shape
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return LayerShape(num, hidden, two_inter // 2, int(getattr(cfg, "num_experts_per_tok", 1)))


def runnable(dtype: torch.dtype, spec: ExpertSpec | None) -> list[str]:
    """The backends of ``MEASURED`` that can run here for these experts (their ``auto_skip_reason``
    heuristics do not apply: the measurement replaces them)."""
    return [n for n in MEASURED if BACKENDS[n].unavailable_reason(dtype, spec) is None]


def pick_backend(
    name: str,
    dtype: torch.dtype,
    spec: ExpertSpec | None,
    quantized: str | None,
    *,  # the measurement's sizes by name
    shape: LayerShape | None,
    threads: int,
    tokens: int,
) -> tuple[ExpertBackend, str]:
    """``select_backend``'s (backend, why), with ``auto`` for bf16 experts of the default layout
    decided by timing each runnable backend at ``shape`` (``threads`` CPU threads, micro-batches
    of ``tokens``); None ``shape`` or any other case: ``select_backend`` as it is."""
    measurable = (
        name == "auto"
        and quantized is None
        and dtype == torch.bfloat16
        and (spec is None or spec.is_default)
        and shape is not None
    )
    names = runnable(dtype, spec) if measurable else []
    if len(names) < 2:
        return select_backend(name, dtype, spec, quantized)
    rates: dict[str, float] = {}
    sources: set[str] = set()
    for n in names:
        rates[n], src = cached_cpu_flops(shape, n, threads, tokens)
        sources.add("cached" if src == "cached" else "measured now")
    best = max(names, key=lambda n: rates[n])
    figures = ", ".join(f"{n} {rates[n] / 1e9:,.1f}" for n in sorted(names, key=lambda n: -rates[n]))
    why = (
        f"auto: {best}, the fastest of the backends that run here timed at this layer's shape "
        f"(GFLOP/s, {threads} threads: {figures}; {' and '.join(sorted(sources))}, {cache_path()})"
    )
    return BACKENDS[best](), why


def pick_for(model: torch.nn.Module, place, chunk_size: int) -> tuple[ExpertBackend, str]:
    """``pick_backend`` for the plan entry ``place`` (an ``ExpertPlacement``) of ``model``, with the
    run's ``chunk_size``: the one call both ``replace_routed_experts`` and ``placement: auto``'s
    start make, so they read the same cache slots and pick the same backend."""
    hf = unwrap_peft(model.get_submodule(place.name))
    spec = place.spec or DEFAULT_SPEC
    return pick_backend(
        place.backend,
        hf.gate_up_proj.dtype,
        spec,
        getattr(getattr(hf.gate_up_proj, "fmt", None), "name", None),
        shape=timing_shape(model, hf, spec),
        threads=place.threads or physical_cpu_cores(),
        tokens=chunk_size,
    )
