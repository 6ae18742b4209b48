"""Attach kt-ft to a model LLaMA-Factory has loaded and wrapped with PEFT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kt_ft.backends.quant_detect import config_source, take_quantization_config
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.base.processes import threads_per_rank, topology
from kt_ft.base.settings import log_changed
from kt_ft.formats.skeleton import meta_model
from kt_ft.integrations.llamafactory.multimodal import expert_lora_trainable
from kt_ft.plan.family import family_of
from kt_ft.plan.loader import load_rules
from kt_ft.plan.recipe import recipe_source
from kt_ft.plan.report import TrainSizes, check_gpu_cap, state_bytes
from kt_ft.runtime.core import apply, plan_for, resolve_rule
from kt_ft.runtime.host_alloc import apply as apply_host_alloc
from kt_ft.runtime.loading import plan_expert_reader, planned_device_map
from kt_ft.runtime.shared_weights import meta_device_map, share_expert_weights, sharing_enabled

logger = get_logger(__name__)


def take_quantization(config: Any, model_args: Any) -> None:
    """A quantized checkpoint's format, noted for ``plan_loading``; its ``quantization_config`` is
    removed from ``config`` (kt-ft reads the quantized tensors itself: ``kt_ft.runtime.quant_loading``).
    A method kt-ft does not read raises here, before any weight is read."""
    name = str(model_args.model_name_or_path)
    source = config_source(name) if Path(name).is_dir() else f"config.json of {name}"
    model_args._kt_ft_quant = take_quantization_config(config, source)


def plan_loading(config: Any, model_args: Any, init_kwargs: dict) -> None:
    """Before any weight is read: plan on a meta skeleton (rule errors stop here), and with CUDA
    load the routed experts straight into CPU RAM and the rest straight to the training GPU."""

    apply_host_alloc(logger)  # before the weights load: the heaps' policy for the whole run
    family = family_of(config)
    current = init_kwargs.get("device_map")
    single = isinstance(current, dict) and list(current) == [""]
    training_device = current[""] if single else "cpu"
    rules = load_rules(resolve_rule(model_args.kt_optimize_rule, family))
    device_map, plan = planned_device_map(
        config, rules, family, model_args.kt_backend, threads_per_rank(model_args.cpu_infer), training_device
    )
    cap = getattr(model_args, "kt_gpu_memory", None)
    if cap is not None and torch.device(training_device).type == "cuda":
        _check_gpu_cap(config, plan, model_args, cap)
    topo = topology()
    expert_names = [e.name for e in plan.experts]
    sharing = single and sharing_enabled(topo.local_world_size)
    if sharing and topo.local_rank != 0:
        # Another rank on this machine loads the experts; this one maps them (shared_weights).
        init_kwargs["device_map"] = meta_device_map(device_map, expert_names)
        logger.info(f"local rank {topo.local_rank}: routed experts not read here (shared from local rank 0)")
        return
    quant = getattr(model_args, "_kt_ft_quant", None)
    if quant is not None and (not single or sharing):
        raise KTConfigError(
            f"{model_args.model_name_or_path}: {quant.name} routed experts are read by one process per machine "
            "with a single training device only in this version"
            + ("; set KT_FT_SHARE_EXPERTS=0 (each rank reads its own quantized copy)" if sharing else "")
        )
    reader = (
        plan_expert_reader(model_args.model_name_or_path, config, expert_names, quant) if single else None
    )
    if reader is not None:
        # transformers loads the rest; kt-ft reads the experts right after (fill_read_experts)
        init_kwargs["device_map"] = reader.device_map(device_map)
        model_args._kt_ft_expert_reader = reader
        # several ranks here: local rank 0 reads them straight into the shared mapping (attach_kt)
        model_args._kt_ft_read_shared = sharing
        logger.info(
            f"loading {len(expert_names)} routed-experts modules ({fmt_bytes(reader.nbytes)} in the files) "
            f"straight from the files into CPU RAM, the rest to {training_device}"
        )
    elif single and torch.cuda.is_available() and torch.device(training_device).type == "cuda":
        init_kwargs["device_map"] = device_map
        logger.info(
            f"loading {len(expert_names)} routed-experts modules into CPU RAM, the rest to {training_device}"
        )


def _check_gpu_cap(config: Any, plan: Any, model_args: Any, cap_gib: float) -> None:
    """``kt_gpu_memory`` too small for the run even with every auto-placed expert on the CPU: stop
    before any weight is read (``rules/report.py`` ``check_gpu_cap``)."""

    sizes = TrainSizes(
        *_micro_batch(model_args),
        getattr(model_args, "_kt_ft_lora_rank", 8),
        state_bytes(getattr(model_args, "_kt_ft_pure_bf16", False)),
    )
    check_gpu_cap(meta_model(config, torch.bfloat16), plan, torch.bfloat16, sizes, cap_gib, recipe_source())


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
