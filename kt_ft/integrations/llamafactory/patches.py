"""Patches applied to LLaMA-Factory 0.9.5 when its modules are imported (see ``kt_ft.integrations.startup``).

* ``llamafactory.hparams.parser``: its ``ModelArguments`` gains kt-ft's keys (``KTArguments``
  overrides LLaMA-Factory's own ``use_kt``), the fork-only dependency check
  (transformers-kt, accelerate-kt) is skipped for kt-ft runs, and the data-parallel engine is
  checked (DeepSpeed and FSDP1 refused, FSDP2 allowed: ``parallel``); a vision-language recipe's
  bad input (images for a text-only model, a scope that freezes everything) is refused
  (``multimodal``).
* ``llamafactory.model.loader``: ``patch_config`` (run before any weight is read) also plans the
  placement on a meta skeleton, raising rule errors early, and with CUDA swaps LLaMA-Factory's
  ``device_map={"": cuda:N}`` for the plan's (routed experts -> "cpu"); ``init_adapter`` runs
  LLaMA-Factory's normal LoRA path, then kt-ft replaces the routed experts and adds their LoRA
  before the parameter count is printed. For gpt-oss, ``patch_config`` also steps around
  LLaMA-Factory 0.9.5's FlashAttention-3 hub-kernel setup, which imports a function transformers
  5.6 does not have (see ``gpt_oss_attention``).
* the tuner and the training workflows: ``workflow``.

With ``use_kt`` false or absent every patched function calls the original unchanged, with one
exception that changes no run LLaMA-Factory accepts: a vision tower's patch-embedding Conv3d, which
LLaMA-Factory refuses under torch 2.9.x, is computed as the equal matmul (``avoid_conv3d_refusal``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.integrations.trainer.parallel import check_raw_recipe, requested_engine
from kt_ft.plan.recipe import KTArguments, recipe_source

logger = get_logger(__name__)


@contextlib.contextmanager
def fork_path_hidden(model_args: Any) -> Iterator[None]:
    """Make LLaMA-Factory's own `use_kt` branches (forked packages) see `use_kt: false`."""
    was = getattr(model_args, "use_kt", False)
    model_args.use_kt = False
    try:
        yield
    finally:
        model_args.use_kt = was


def make_kt_model_arguments(model_arguments: type) -> type:
    """LLaMA-Factory's ModelArguments with KTArguments' fields and validation layered on top."""
    cls = dataclasses.make_dataclass(
        model_arguments.__name__,
        [],
        bases=(KTArguments, model_arguments),
        namespace={"__doc__": model_arguments.__doc__},
    )
    cls.__module__ = __name__
    cls.__qualname__ = model_arguments.__qualname__
    cls._kt_ft_base = model_arguments
    return cls


def check_kt_run(model_args: Any, finetuning_args: Any, *, source: str | None = None) -> None:
    """Recipe combinations kt-ft cannot run, refused before any weight is loaded (``source``: the
    file the messages name; default the recipe on the command line)."""
    src = source or recipe_source()
    problems = []
    if finetuning_args.finetuning_type != "lora":
        problems.append(
            f"{src}: finetuning_type={finetuning_args.finetuning_type!r} with use_kt: kt-ft trains LoRA; valid: lora"
        )
    if finetuning_args.stage not in ("sft", "pt"):
        problems.append(f"{src}: stage={finetuning_args.stage!r} with use_kt: kt-ft supports stages sft, pt")
    if getattr(model_args, "quantization_bit", None) is not None:
        problems.append(
            f"{src}: quantization_bit={model_args.quantization_bit!r} with use_kt: not supported (remove it)"
        )
    backend = str(getattr(model_args, "infer_backend", "huggingface"))
    if backend != "huggingface":
        problems.append(
            f"{src}: infer_backend={backend!r} with use_kt: only the huggingface engine runs kt-ft's experts "
            "(and loads their LoRA); for vllm or sglang, `kt-ft convert` or `kt-ft merge` the adapter and set "
            "use_kt: false"
        )
    if getattr(finetuning_args, "use_dora", False):
        problems.append(f"{src}: use_dora=true with use_kt: expert LoRA is plain LoRA; remove use_dora")
    if problems:
        raise KTConfigError(problems)


def patch_parser_module(parser: ModuleType) -> None:
    if getattr(parser, "_kt_ft_patched", False):
        return
    base = parser.ModelArguments
    kt_cls = make_kt_model_arguments(base)
    for list_name in ("_TRAIN_ARGS", "_INFER_ARGS", "_EVAL_ARGS", "_TRAIN_MCA_ARGS"):
        arg_list = getattr(parser, list_name, None)
        if isinstance(arg_list, list):
            arg_list[:] = [kt_cls if c is base else c for c in arg_list]
    parser.ModelArguments = kt_cls

    original_check = parser._check_extra_dependencies

    def _check_extra_dependencies(model_args, finetuning_args, training_args=None):
        if not getattr(model_args, "use_kt", False):
            return original_check(model_args, finetuning_args, training_args)
        if training_args is not None:  # DeepSpeed / FSDP1 refused here, before LF's own checks
            requested_engine(training_args)
        with fork_path_hidden(model_args):
            original_check(model_args, finetuning_args, training_args)
        check_kt_run(model_args, finetuning_args)

    parser._check_extra_dependencies = _check_extra_dependencies

    original_parse_train = parser._parse_train_args

    def _parse_train_args(args=None):
        check_raw_recipe(args)  # before HF's TrainingArguments sets DeepSpeed up
        parsed = original_parse_train(args)
        model_args, data_args, _, finetuning_args, _ = parsed
        if getattr(model_args, "use_kt", False):
            from kt_ft.integrations.llamafactory.multimodal import (
                check_multimodal_recipe,  # why: reads the model's config (transformers)
            )

            check_multimodal_recipe(model_args, data_args, finetuning_args)
        return parsed

    parser._parse_train_args = _parse_train_args
    parser._kt_ft_patched = True


def _hub_kernel_loader_missing() -> bool:
    try:
        from transformers.integrations.hub_kernels import load_and_register_kernel  # noqa: F401
    except ImportError:
        return True
    return False


@contextlib.contextmanager
def gpt_oss_attention(patcher: ModuleType, config: Any) -> Iterator[None]:
    """For a gpt-oss config, while LLaMA-Factory's ``patch_config`` runs: where transformers lacks
    ``load_and_register_kernel`` (5.6 does), LLaMA-Factory 0.9.5's gpt-oss branch of
    ``configure_attn_implementation`` (FlashAttention-3 with sinks, a hub kernel) raises ImportError
    before any weight is read; use eager attention instead, which computes gpt-oss's attention sinks
    (transformers' sdpa does not support gpt-oss). Every other model: no change."""
    original = getattr(patcher, "configure_attn_implementation", None)
    if (
        getattr(config, "model_type", None) != "gpt_oss"
        or original is None
        or not _hub_kernel_loader_missing()
    ):
        yield
        return

    def configure_attn_implementation(config, model_args):
        logger.warning(
            "gpt-oss: LLaMA-Factory's FlashAttention-3 hub kernel needs transformers' load_and_register_kernel, "
            "which this transformers does not have; using eager attention (it computes the attention sinks; "
            "its memory grows with cutoff_len squared)"
        )
        model_args.flash_attn = "disabled"
        config._attn_implementation = "eager"

    patcher.configure_attn_implementation = configure_attn_implementation
    try:
        yield
    finally:
        patcher.configure_attn_implementation = original


def patch_loader_module(loader: ModuleType) -> None:
    if getattr(loader, "_kt_ft_patched", False):
        return
    original_init_adapter = loader.init_adapter

    def init_adapter(config, model, model_args, finetuning_args, is_trainable):
        if not getattr(model_args, "use_kt", False):
            return original_init_adapter(config, model, model_args, finetuning_args, is_trainable)
        check_kt_run(model_args, finetuning_args)
        with fork_path_hidden(model_args):
            model = original_init_adapter(config, model, model_args, finetuning_args, is_trainable)
        from kt_ft.integrations.llamafactory.model import (
            attach_kt,  # why: LF imports this hook module; torch and the model code load on use
        )

        attach_kt(model, model_args, finetuning_args, is_trainable)
        return model

    original_patch_config = loader.patch_config

    def patch_config(config, tokenizer, model_args, init_kwargs, is_trainable):
        if not getattr(model_args, "use_kt", False):
            return original_patch_config(config, tokenizer, model_args, init_kwargs, is_trainable)
        from kt_ft.integrations.llamafactory.model import (  # why: as attach_kt above
            plan_loading,
            take_quantization,
        )

        # before LLaMA-Factory's own quantization set-up reads it: an fp8 / int4 / int8 / mxfp4 checkpoint is
        # read by kt-ft (its config then has no quantization_config), any other method is refused here
        take_quantization(config, model_args)
        with gpt_oss_attention(sys.modules[original_patch_config.__module__], config):
            original_patch_config(config, tokenizer, model_args, init_kwargs, is_trainable)

        plan_loading(config, model_args, init_kwargs)

    original_patch_model = loader.patch_model

    def patch_model(model, tokenizer, model_args, *args, **kwargs):
        if getattr(model_args, "use_kt", False):
            from kt_ft.integrations.llamafactory.model import fill_read_experts  # why: as attach_kt above

            # right after from_pretrained, before LLaMA-Factory touches the parameters
            fill_read_experts(model, model_args)
        # Vision towers: with or without use_kt, where LLaMA-Factory would otherwise refuse the
        # model outright (Conv3d under torch 2.9.x), so no run it accepts is changed.
        avoid_conv3d_refusal(model)
        return original_patch_model(model, tokenizer, model_args, *args, **kwargs)

    loader.init_adapter = init_adapter
    loader.patch_config = patch_config
    loader.patch_model = patch_model
    loader._kt_ft_patched = True


def conv3d_refused(model: Any) -> bool:
    """LLaMA-Factory 0.9.5's condition (``load_model``): torch >= 2.9.0 and < 2.10.0, and an
    ``nn.Conv3d`` in the model."""
    from llamafactory.extras.packages import is_torch_version_greater_than
    from torch import nn

    in_range = is_torch_version_greater_than("2.9.0") and not is_torch_version_greater_than("2.10.0")
    return in_range and any(isinstance(m, nn.Conv3d) for m in model.modules())


def avoid_conv3d_refusal(model: Any) -> None:
    """Where LLaMA-Factory would refuse the model (``conv3d_refused``), swap its patch-embedding
    Conv3d for the equal matmul and say so; otherwise leave the model alone."""
    if not conv3d_refused(model):
        return
    from kt_ft.backends.patch_conv import replace_patch_conv3d  # why: torch and the model code load on use

    names = replace_patch_conv3d(model)
    logger.info(
        f"{', '.join(names)}: Conv3d (stride == kernel) computed as a matmul, same weights "
        "(LLaMA-Factory refuses Conv3d under torch 2.9.x)"
    )
