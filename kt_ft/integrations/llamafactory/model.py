"""Attach kt-ft to a model LLaMA-Factory has loaded and wrapped with PEFT."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import torch

from kt_ft.backends.lora_linear import install_fused_lora
from kt_ft.backends.quant_detect import config_source, take_quantization_config
from kt_ft.backends.rms_norm import install_fused_rms_norm
from kt_ft.backends.rotary import install_fused_rotary
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.base.processes import threads_per_rank, topology
from kt_ft.base.settings import log_changed
from kt_ft.base.version import __version__
from kt_ft.formats.manifest import (
    CHECKPOINT_DIR,
    KTAdapterInfo,
    base_config_sha256,
    read_manifest,
    verify_adapter_dir,
)
from kt_ft.formats.skeleton import meta_model
from kt_ft.integrations.llamafactory.multimodal import expert_lora_trainable
from kt_ft.plan.family import family_of
from kt_ft.plan.loader import load_rules
from kt_ft.plan.recipe import recipe_source
from kt_ft.plan.report import TrainSizes, check_gpu_cap, state_bytes
from kt_ft.runtime.adapter import load_kt_adapter_experts, save_kt_adapter
from kt_ft.runtime.core import KTConfig, apply, plan_for, resolve_rule
from kt_ft.runtime.distributed import setup_data_parallel
from kt_ft.runtime.host_alloc import apply as apply_host_alloc
from kt_ft.runtime.loading import plan_expert_reader, planned_device_map
from kt_ft.runtime.shared_weights import meta_device_map, share_expert_weights, sharing_enabled

logger = get_logger(__name__)

# kt-ft adds a "kt_ft" block to PEFT's adapter_config.json; PEFT ignores it but warns, wrongly,
# that the file may come from a newer PEFT. Silence exactly that warning in kt-ft processes.
warnings.filterwarnings("ignore", message=r"Unexpected keyword arguments \['kt_ft'\]", category=UserWarning)


def _rss_bytes() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("nan")


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
    """Replace routed experts by kt-ft's CPU experts (with expert LoRA) and hook saving."""

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
    src = adapters[-1] if adapters else None
    rank = finetuning_args.lora_rank
    alpha = finetuning_args.lora_alpha if finetuning_args.lora_alpha is not None else rank * 2
    use_rslora = bool(finetuning_args.use_rslora)
    if src is not None and not is_trainable:
        # Inference: the adapter, not the chat/export recipe, says what rank the expert LoRA has.
        lora = read_manifest(src)["lora"]
        rank, alpha, use_rslora = lora["rank"], lora["alpha"], lora["use_rslora"]
    cutoff, batch = _micro_batch(model_args)
    config = KTConfig(
        rule=model_args.kt_optimize_rule,
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        backend=model_args.kt_backend,
        threads=threads,
        chunk_size=model_args.chunk_size,
        gpu_memory_gib=getattr(model_args, "kt_gpu_memory", None),
        cutoff_len=cutoff,
        batch=batch,
        replan_steps=getattr(model_args, "kt_replan_steps", 0),
        replan_threshold=getattr(model_args, "kt_replan_threshold", 0.1),
        remeasure=bool(getattr(model_args, "kt_remeasure", False)),
        # pure_bf16: LLaMA-Factory keeps PEFT's LoRA bf16 (no fp32 upcast); the expert LoRA follows
        lora_dtype=torch.bfloat16 if getattr(finetuning_args, "pure_bf16", False) else torch.float32,
    )
    plan, rule_path = plan_for(model, config)
    if topo.local_world_size > 1:
        logger.info(
            f"cpu_infer={model_args.cpu_infer} shared by {topo.local_world_size} ranks on this machine: "
            f"{threads} expert threads per rank"
        )
        if share:
            reader = take_expert_reader(model_args)
            fill = _fill_under_peft(model, reader) if reader is not None else None
            share_expert_weights(model, [e.name for e in plan.experts], topo.local_rank, fill=fill)
    run = apply(model, config, plan=plan, trainable=is_trainable)
    summary = run.summary
    if run.replanner is not None:
        model._kt_ft_replanner = run.replanner  # the trainer callback steps it
    info = KTAdapterInfo(
        base_model=str(model_args.model_name_or_path),
        base_config_sha256=base_config_sha256(model_args.model_name_or_path),
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        layers=summary.layers,
        num_experts=summary.num_experts,
        targets=[_strip_peft_prefix(p.name) for p in plan.experts],
        backend=summary.backend,
        rule=str(rule_path),
        kt_ft_version=__version__,
        base_format=summary.base_format,
    )
    model._kt_ft_info = info

    # A vision-language recipe that freezes the language model freezes its routed experts' LoRA too.
    experts_trainable = is_trainable and expert_lora_trainable(model.config, finetuning_args)
    if src is not None:
        # LLaMA-Factory has already loaded (and, for inference, merged) PEFT's non-expert part.
        load_kt_adapter_experts(model, src, info, trainable=experts_trainable)
        logger.info(f"loaded expert LoRA from {src} (manifest, sizes and sha256 checked)")

    if not experts_trainable:
        if is_trainable:
            logger.info("freeze_language_model: the expert LoRA of the language model stays frozen")
        for m in model.modules():
            if hasattr(m, "runner"):
                for p in m.lora_tensors():
                    p.requires_grad_(False)
    if is_trainable:
        setup_data_parallel(model)  # several processes: DDP setup and expert-LoRA grad averaging

    _hook_save_pretrained(model, info)
    _hook_load_adapter(model, info, experts_trainable)
    install_fused_lora(model)  # PEFT's LoRA linears as one autograd node each (KT_FT_FUSED_LORA)
    install_fused_rms_norm(model)  # RMSNorm through torch's rms_norm (KT_FT_FUSED_NORM)
    install_fused_rotary(model)  # q and k's rotary embedding as one autograd node (KT_FT_FUSED_ROPE)
    gpu_bytes = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if not _is_routed_expert_param(n, model)
    )
    logger.info(
        f"{summary.line()}; {rule_path.name} from {rule_path.parent}; non-expert weights {fmt_bytes(gpu_bytes)} "
        f"go to {summary.default_device}; process RSS {fmt_bytes(_rss_bytes())}"
    )
    if torch.cuda.is_available():
        logger.info(f"GPU memory allocated now: {fmt_bytes(torch.cuda.memory_allocated())}")


def _fill_under_peft(model: Any, reader: Any):
    """``reader.fill`` for the model inside PEFT's wrapper (the reader's names are the loaded
    model's), taking an allocator that expects the wrapper's names (the shared file's slots)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = next(n for n, m in model.named_modules() if m is base)
    prefix = f"{inner}." if inner else ""

    def fill(allocate):
        return reader.fill(base, lambda name, shape, dtype: allocate(prefix + name, shape, dtype))

    return fill


def _is_routed_expert_param(name: str, model: Any) -> bool:
    module_name = name.rpartition(".")[0]
    try:
        return hasattr(model.get_submodule(module_name), "runner")
    except AttributeError:
        return False


def _strip_peft_prefix(name: str) -> str:
    return name.removeprefix("base_model.model.")


def _hook_save_pretrained(model: Any, info: KTAdapterInfo) -> None:
    """Make ``model.save_pretrained`` (what the Trainer calls for every checkpoint and the final
    output) crash-safe and make it write the fused expert LoRA and the manifest too.

    In a trainer's checkpoint-N dir the manifest waits for the optimizer and trainer state
    (``KTCheckpointCallback.on_save`` writes it) when that callback runs in this training."""
    original = model.save_pretrained
    if getattr(original, "_kt_ft", False):
        return

    @functools.wraps(original)
    def save_pretrained(save_directory, *args, **kwargs):
        if not kwargs.get("is_main_process", True):
            return original(save_directory, *args, **kwargs)
        from peft import PeftModel

        if not isinstance(model, PeftModel):
            # `llamafactory-cli export`: PEFT's part is merged, but a full save would write the
            # expert LoRA as stray tensors that loaders drop, silently: refuse, point to the tool.
            raise KTConfigError(
                f"export to {save_directory} with use_kt: LLaMA-Factory's export cannot fold the expert LoRA; "
                "run `kt-ft merge ADAPTER_DIR OUT` (merged model) or `kt-ft convert ADAPTER_DIR OUT` (per-expert LoRA)"
            )
        defer = getattr(model, "_kt_ft_defer_checkpoint_manifest", False) and bool(
            CHECKPOINT_DIR.fullmatch(Path(save_directory).name)
        )
        return save_kt_adapter(
            model, save_directory, info, original, *args, with_manifest=not defer, **kwargs
        )

    save_pretrained._kt_ft = True
    model.save_pretrained = save_pretrained


def _hook_load_adapter(model: Any, info: KTAdapterInfo, experts_trainable: bool = True) -> None:
    """The HF Trainer resumes a PEFT model with ``model.load_adapter(checkpoint_dir, name,
    is_trainable=True)`` before it loads the optimizer state: check the checkpoint against its
    manifest first (fail closed), let PEFT load its part, then load the expert LoRA and keep it
    trainable (PEFT only manages ``lora_`` params) unless the run froze it (``experts_trainable``
    False: a vision-language recipe with ``freeze_language_model``)."""
    original = getattr(model, "load_adapter", None)
    if original is None or getattr(original, "_kt_ft", False):
        return

    @functools.wraps(original)
    def load_adapter(model_id, adapter_name, *args, **kwargs):
        is_trainable = kwargs.get("is_trainable", args[0] if args else False)
        verify_adapter_dir(model_id, info)
        result = original(model_id, adapter_name, *args, **kwargs)
        trainable = bool(is_trainable) and experts_trainable
        load_kt_adapter_experts(model, model_id, info, trainable=trainable, verify=False)
        logger.info(f"resumed expert LoRA from {Path(model_id)} (manifest, sizes and sha256 checked)")
        return result

    load_adapter._kt_ft = True
    model.load_adapter = load_adapter
