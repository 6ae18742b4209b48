"""Replace a model's routed-experts modules with KTExperts, following a placement plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kt_ft.backends.base import DEFAULT_SPEC, ExpertBackend
from kt_ft.backends.kt_kernel import chain_backward_order
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.plan.family import unwrap_peft
from kt_ft.plan.homes import lora_home, pick_resident_ids, pick_stream_ids
from kt_ft.plan.placement import PlacementPlan
from kt_ft.runtime.backend_pick import pick_for
from kt_ft.runtime.beside import install_shared_beside
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.streamed import StreamScheduler

logger = get_logger(__name__)


@dataclass(kw_only=True)  # twelve fields, several of one type: by name only
class KTSummary:
    layers: list[int]
    num_experts: int
    backend: str
    backend_reason: str
    threads: int | None
    lora_params: int
    expert_bytes: int  # frozen routed-expert weights held in CPU RAM
    default_device: torch.device
    resident: dict[int, tuple[int, ...]] | None = None  # layer -> experts computed on the training device
    streamed: dict[int, tuple[int, ...]] | None = None  # layer -> experts streamed to the training device
    scheduler: StreamScheduler | None = None  # the model's stream scheduler (None: nothing streams)
    lora_on_device: tuple[int, ...] = ()  # layers whose expert LoRA lives on the training device
    base_format: str = ""  # the routed experts' storage: a dtype (bf16, ...) or a quantized format (fp8, ...)

    def line(self) -> str:
        return (
            f"{self.num_experts} experts x {len(self.layers)} MoE layers on cpu via backend {self.backend} "
            f"({self.backend_reason}) with {self.threads} threads; the rest on {self.default_device}; "
            f"expert-LoRA params {self.lora_params:,}; routed-expert weights {fmt_bytes(self.expert_bytes)} in RAM"
            + (f" ({self.base_format})" if self.base_format else "")
            + (f"; GPU-resident experts {_ids_text(self.resident)}" if self.resident else "")
            + (
                f"; streamed experts {_ids_text(self.streamed)} (device buffers "
                f"{fmt_bytes(self.scheduler.buffer_bytes())})"
                if self.streamed
                else ""
            )
            + (
                f"; expert LoRA of {len(self.lora_on_device)} layers (those with experts on the GPU) on "
                f"{self.default_device}"
                if self.lora_on_device
                else ""
            )
        )


def _ids_text(by_layer: dict[int, tuple[int, ...]]) -> str:
    by_ids: dict[tuple[int, ...], list[int]] = {}
    for layer, ids in by_layer.items():
        by_ids.setdefault(ids, []).append(layer)
    return ", ".join(f"layers {layers} ids {list(ids)}" for ids, layers in by_ids.items())


def replace_routed_experts(
    model: torch.nn.Module,
    plan: PlacementPlan,
    rank: int,
    scaling: float,
    chunk_size: int,
    seed: int | None = None,
    lora_dtype: torch.dtype = torch.float32,
) -> KTSummary:
    """Swap every planned experts module for a KTExperts (same parameters, added expert LoRA).

    ``seed`` makes the expert-LoRA init reproducible (one generator walks the layers in order);
    ``lora_dtype``: the expert LoRA's parameters (bfloat16 under LLaMA-Factory's ``pure_bf16``).
    """
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    backends: dict[str, tuple] = {}
    resident: dict[int, tuple[int, ...]] = {}
    streamed: dict[int, tuple[int, ...]] = {}
    scheduler = StreamScheduler()  # one per model: the layers share its device buffers
    lora_params = expert_bytes = 0
    base_format = ""
    num_experts = 0
    lora_dev_layers: list[int] = []
    peft_wrapped = False
    overlapped: set[str] = set()
    cpu_backends: list[tuple[int, ExpertBackend]] = []
    for place in plan.experts:
        parent_name, _, child = place.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped = getattr(parent, child)
        hf = unwrap_peft(wrapped)
        if hf is not wrapped and not peft_wrapped:
            logger.warning(
                f"{place.name} (and any other): PEFT put its own LoRA on the fused experts (a LoRA target "
                "matched their parameters); kt-ft trains the expert LoRA itself and drops PEFT's there. Newer PEFT "
                "also removes gate_proj/up_proj/down_proj from target_modules for some MoE families, so shared "
                "experts and dense MLPs may have no LoRA (README: Known traps)"
            )
        peft_wrapped = peft_wrapped or hf is not wrapped
        spec = place.spec or DEFAULT_SPEC
        key = (place.backend, spec)
        if key not in backends:
            backends[key] = pick_for(model, place, chunk_size)
        proto, reason = backends[key]
        backend = type(proto)()  # one instance per layer: a backend may keep per-layer state
        gpu = place.gpu_experts
        # a count takes the first ids: no routing counts exist before training (docs/placement.md: GPU-resident experts)
        num = hf.gate_up_proj.shape[0]
        ids = pick_resident_ids(num, gpu.ids, gpu.count) if gpu is not None else ()
        if ids:
            resident[place.layer] = ids
        st = place.stream_experts  # a count: the first non-resident ids (docs/placement.md: Streamed experts)
        stream_ids = pick_stream_ids(num, ids, st.ids, st.count) if st is not None else ()
        if stream_ids:
            streamed[place.layer] = stream_ids
        kt = KTExperts(
            hf,
            layer_idx=place.layer,
            rank=rank,
            scaling=scaling,
            lora_dtype=lora_dtype,
            backend=backend,
            chunk_size=chunk_size,
            threads=place.threads,
            generator=gen,
            spec=spec,
            resident_ids=ids,
            stream_ids=stream_ids,
            scheduler=scheduler,
            lora_device=lora_home(
                plan.default_device, bool(ids or stream_ids), keep_on_cpu=place.lora_on_gpu is False
            ),
        )
        # a layer computed on the CPU alone under a fixed split: a backend with a copy of the weights
        # of its own (kt-kernel) lets kt-ft's go (``function.py`` ``free_base_when_held``)
        kt.runner.free_base_when_held = place.placement != "auto" and not ids and not stream_ids
        cpu_backends.append((place.layer, kt.runner.backend))
        setattr(parent, child, kt)
        how = install_shared_beside(parent, kt, parent_name)
        if how is not None:
            overlapped.add(how)
        num_experts = kt.num_experts
        if kt.lora_on_device:
            lora_dev_layers.append(place.layer)
        lora_params += sum(t.numel() for t in kt.lora_tensors())
        base = kt.runner.base
        base_format = base.quantized or str(base.gate_up.dtype).removeprefix("torch.").replace(
            "bfloat16", "bf16"
        )
        expert_bytes += kt.base_nbytes()
    chain_backward_order([b for _, b in sorted(cpu_backends, key=lambda lb: lb[0])])
    if overlapped:
        logger.info(f"shared experts: {'; '.join(sorted(overlapped))}")
    names = ", ".join(sorted({b.name for b, _ in backends.values()}))
    reasons = "; ".join(sorted({r for _, r in backends.values()}))
    threads = plan.experts[0].threads if plan.experts else None
    return KTSummary(
        layers=[p.layer for p in plan.experts],
        num_experts=num_experts,
        backend=names,
        backend_reason=reasons,
        threads=threads,
        lora_params=lora_params,
        expert_bytes=expert_bytes,
        default_device=plan.default_device,
        resident=resident,
        streamed=streamed,
        scheduler=scheduler if streamed else None,
        lora_on_device=tuple(lora_dev_layers),
        base_format=base_format,
    )
