"""Attach kt-ft to a model LLaMA-Factory has loaded and wrapped with PEFT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kt_ft.backends.quant_detect import config_source, take_quantization_config
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.base.processes import threads_per_rank, topology
from kt_ft.base.settings import log_changed
from kt_ft.integrations.llamafactory.multimodal import expert_lora_trainable
from kt_ft.plan.recipe import recipe_source
from kt_ft.runtime.core import apply, plan_for
from kt_ft.runtime.preload import prepare_loading
from kt_ft.runtime.shared_weights import share_expert_weights, sharing_enabled

logger = get_logger(__name__)


def take_quantization(config: Any, model_args: Any) -> None:
    """A quantized checkpoint's format, noted for ``plan_loading``; its ``quantization_config`` is
    removed from ``config`` (kt-ft reads the quantized tensors itself: ``kt_ft.runtime.quant_loading``).
    A method kt-ft does not read raises here, before any weight is read."""
    name = str(model_args.model_name_or_path)
    source = config_source(name) if Path(name).is_dir() else f"config.json of {name}"
    model_args._kt_ft_quant = take_quantization_config(config, source)


def plan_loading(config: Any, model_args: Any, init_kwargs: dict) -> None:
    """Before any weight is read (``kt_ft.runtime.preload``): the device map LLaMA-Factory's
    ``from_pretrained`` uses, and the expert reader ``fill_read_experts`` / ``attach_kt`` run."""
    current = init_kwargs.get("device_map")
    single = isinstance(current, dict) and list(current) == [""]
    cutoff, batch = _micro_batch(model_args)
    kt = model_args.kt_config(
        threads=threads_per_rank(model_args.cpu_infer),
        rank=getattr(model_args, "_kt_ft_lora_rank", 8),  # PEFT's LoRA counts in the GPU-cap check
        cutoff_len=cutoff,
        batch=batch,
        lora_dtype=torch.bfloat16 if getattr(model_args, "_kt_ft_pure_bf16", False) else torch.float32,
    )
    loading = prepare_loading(
        config,
        str(model_args.model_name_or_path),
        kt,
        training_device=current[""] if single else "cpu",
        single_device=single,
        quant=getattr(model_args, "_kt_ft_quant", None),
        source=recipe_source(),
    )
    if loading.device_map is not None:
        init_kwargs["device_map"] = loading.device_map
    model_args._kt_ft_expert_reader = loading.reader
    model_args._kt_ft_read_shared = loading.shared


def _micro_batch(model_args: Any) -> tuple[int, int]:
    """(cutoff_len, per_device_train_batch_size), noted by ``KTArguments.apply_kt_config``; before
    LLaMA-Factory has called it, (model_max_length or 2048, 1)."""
    return getattr(model_args, "_kt_ft_micro_batch", None) or (model_args.model_max_length or 2048, 1)


def take_expert_reader(model_args: Any):
    """The ExpertReader ``plan_loading`` left to fill (routed experts on ``meta``), once; else None."""
    reader = getattr(model_args, "_kt_ft_expert_reader", None)
    model_args._kt_ft_expert_reader = None
    return reader


def fill_read_experts(model: Any, model_args: Any) -> None:
    """Read the routed experts that ``plan_loading`` kept out of ``from_pretrained`` (on ``meta``)
    into private CPU memory; once. Not where the experts go to a shared mapping (``attach_kt``)."""
    if getattr(model_args, "_kt_ft_read_shared", False):
        return
    reader = take_expert_reader(model_args)
    if reader is not None:
        reader.fill(model)


def attach_kt(model: Any, model_args: Any, finetuning_args: Any, is_trainable: bool) -> None:
    """Map the recipe to a ``KTConfig`` and ``kt_ft.apply`` it to the model LLaMA-Factory loaded
    and wrapped with PEFT (which has also loaded, and for inference merged, an adapter's PEFT part);
    with several ranks on this machine, local rank 0 first reads the routed experts into the
    mapping they share."""

    log_changed(logger)  # environment switches set to other than their default, once a process
    topo = topology()
    share = topo.local_world_size > 1 and topo.distributed and sharing_enabled(topo.local_world_size)
    if not share:  # experts still on meta (normally filled before LLaMA-Factory's patch_model)
        reader = take_expert_reader(model_args)
        if reader is not None:
            reader.fill(model)
    threads = threads_per_rank(model_args.cpu_infer, topo)
    adapters = model_args.adapter_name_or_path or []
    if len(adapters) > 1:
        raise KTConfigError(
            f"adapter_name_or_path={adapters!r}: with use_kt, kt-ft loads the expert LoRA of one adapter; "
            "merge the others first (kt-ft merge)"
        )
    rank = finetuning_args.lora_rank
    cutoff, batch = _micro_batch(model_args)
    config = model_args.kt_config(
        threads=threads,
        rank=rank,
        alpha=finetuning_args.lora_alpha if finetuning_args.lora_alpha is not None else rank * 2,
        use_rslora=bool(finetuning_args.use_rslora),
        cutoff_len=cutoff,
        batch=batch,
        # pure_bf16: LLaMA-Factory keeps PEFT's LoRA bf16 (no fp32 upcast); the expert LoRA follows
        lora_dtype=torch.bfloat16 if getattr(finetuning_args, "pure_bf16", False) else torch.float32,
        adapter=adapters[-1] if adapters else None,
        base_model=str(model_args.model_name_or_path),
        # a vision-language recipe that freezes the language model freezes its routed experts' LoRA too
        experts_trainable=expert_lora_trainable(model.config, finetuning_args),
    )
    plan, _ = plan_for(model, config)
    if topo.local_world_size > 1:
        logger.info(
            f"cpu_infer={model_args.cpu_infer} shared by {topo.local_world_size} ranks on this machine: "
            f"{threads} expert threads per rank"
        )
        if share:
            reader = take_expert_reader(model_args)
            fill = _fill_under_peft(model, reader) if reader is not None else None
            share_expert_weights(model, [e.name for e in plan.experts], topo.local_rank, fill=fill)
    apply(model, config, plan=plan, trainable=is_trainable)


def _fill_under_peft(model: Any, reader: Any):
    """``reader.fill`` for the model inside PEFT's wrapper (the reader's names are the loaded
    model's), taking an allocator that expects the wrapper's names (the shared file's slots)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = next(n for n, m in model.named_modules() if m is base)
    prefix = f"{inner}." if inner else ""

    def fill(allocate):
        return reader.fill(base, lambda name, shape, dtype: allocate(prefix + name, shape, dtype))

    return fill
