"""The HF Trainer under FSDP2 (accelerate's ``fully_shard`` path) for a kt-ft model.

What accelerate 1.11 and transformers 5.6 do by themselves under FSDP2, and what kt-ft changes
(only for a model kt-ft attached to and only when accelerate really runs FSDP2):

* **Wrapping.** accelerate calls ``fully_shard`` on each auto-wrapped module (e.g. the decoder
  layers) and the root, with ``ignored_params`` taken from the plugin's ``ignored_modules``.
  kt-ft adds every ``KTExperts`` module there (``create_accelerator_and_postprocess``), so
  their frozen base weights (in shared CPU memory) and expert LoRA are not sharded, not moved
  to the GPU and not reduced by FSDP: one copy per machine, computed on the CPU, the LoRA
  gradients averaged by kt-ft over gloo (``kt_ft.runtime.distributed``). Attention, shared experts,
  router and PEFT LoRA are sharded as the recipe asks.
* **Clipping.** ``torch.nn.utils.clip_grad_norm_`` (what accelerate uses under FSDP2) refuses
  the mix of DTensor and plain gradients; kt-ft's ``kt_ft.runtime.fsdp.clip_grad_norm_`` computes the
  same global norm and scaling.
* **Checkpoints.** FSDP2's own format (a ``pytorch_model_fsdp_0`` / ``optimizer_0``
  distributed-checkpoint directory per checkpoint, and, with accelerate's default
  ``SHARDED_STATE_DICT``, no adapter file at all) is replaced by kt-ft's usual layout, written
  by rank 0: ``adapter_model.safetensors`` (the PEFT state dict, its shards all-gathered to
  whole tensors first), ``fused_expert_lora.safetensors`` (+ the fp32 master), one whole
  ``optimizer.pt`` in torch's index-keyed layout (states all-gathered), ``scheduler.pt``, the
  RNG states and the manifest. The same files as a DDP or one-process run: a checkpoint
  resumes under DDP, FSDP2 or one process, on any number of processes. Resume copies the
  whole tensors back into the live shards (no full-model state dict is ever gathered).
"""

from __future__ import annotations

import os
import types
import warnings
from pathlib import Path
from typing import Any

import torch

from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.formats.manifest import verify_adapter_dir
from kt_ft.runtime.adapter import kt_expert_modules, load_kt_adapter_experts
from kt_ft.runtime.fsdp import (
    clip_grad_norm_,
    copy_full_into,
    full_optimizer_state,
    gather_full,
    is_sharded,
    shard_optimizer_state,
    unfuse_mixed_groups,
)

logger = get_logger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _kt_info_of(model: Any):
    return getattr(model, "_kt_ft_info", None)


def _kt_info(trainer: Any):
    return _kt_info_of(trainer.model)


def kt_fsdp2(trainer: Any) -> bool:
    """True when ``trainer`` trains a kt-ft model under FSDP2."""
    if _kt_info(trainer) is None or not getattr(trainer, "is_fsdp_enabled", False):
        return False
    return getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2


def _fsdp_asked(trainer: Any) -> bool:
    return (
        bool(getattr(trainer.args, "fsdp", None))
        or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    )


def _ignored_modules(existing: Any, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The plugin's own ``ignored_modules`` (modules, or accelerate's regex over module names)
    plus every KTExperts module, each once."""
    import re

    if isinstance(existing, str):
        pattern = re.compile(existing)
        existing = [m for n, m in model.named_modules() if pattern.fullmatch(n)]
    modules = list(existing or [])
    return modules + [m for m in kt_expert_modules(model) if all(m is not e for e in modules)]


def setup_fsdp2(trainer: Any) -> None:
    """After the Trainer made its Accelerator: keep the routed experts out of ``fully_shard`` and
    give accelerate a clipping that handles the DTensor / plain mix. A no-op without kt-ft."""
    if _kt_info(trainer) is None:
        return
    if not getattr(trainer, "is_fsdp_enabled", False):
        if _fsdp_asked(trainer):
            logger.warning(
                f"the recipe asks for FSDP but accelerate runs {trainer.accelerator.distributed_type} here "
                "(accelerate 1.11 runs FSDP only on GPUs and other accelerators): kt-ft trains with DDP"
            )
        return
    plugin = trainer.accelerator.state.fsdp_plugin
    if plugin.fsdp_version != 2:  # the parser refuses it earlier; this is accelerate's final word
        raise KTConfigError(
            f"accelerate's FSDP plugin has fsdp_version={plugin.fsdp_version} with use_kt: only FSDP2 is supported"
        )
    plugin.ignored_modules = _ignored_modules(plugin.ignored_modules, trainer.model)
    experts = kt_expert_modules(trainer.model)
    accelerator = trainer.accelerator

    def kt_clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        self.unscale_gradients()
        return clip_grad_norm_(parameters, max_norm, norm_type)

    prepare = accelerator.prepare

    def kt_prepare(*args, **kwargs):
        result = prepare(*args, **kwargs)
        _after_prepare(result if isinstance(result, (list, tuple)) else [result])
        return result

    accelerator.clip_grad_norm_ = types.MethodType(kt_clip_grad_norm_, accelerator)
    accelerator.prepare = kt_prepare
    logger.info(
        f"FSDP2: {len(experts)} routed-experts modules ({sum(len(list(m.parameters())) for m in experts)} params) "
        "go to fully_shard as ignored params: not sharded, not moved, not reduced by FSDP (one CPU copy per "
        f"machine; expert-LoRA grads averaged by kt-ft); the rest sharded over {accelerator.num_processes} ranks"
    )


def _after_prepare(prepared: list[Any]) -> None:
    """Once accelerate has run ``fully_shard``: say what it sharded, and keep the optimizer's fused
    kernels away from groups mixing shards and plain tensors on one device."""
    for obj in prepared:
        if isinstance(obj, torch.nn.Module) and _kt_info_of(obj) is not None:
            from torch.distributed.fsdp import FSDPModule

            params = list(obj.parameters())
            sharded = sum(is_sharded(p) for p in params)
            units = sum(isinstance(m, FSDPModule) for m in obj.modules())
            logger.info(
                f"FSDP2 wrapped the model in {units} units: {sharded} parameters sharded (DTensor), "
                f"{len(params) - sharded} kept whole (routed experts, on the CPU)"
            )
        if isinstance(obj, torch.optim.Optimizer) and unfuse_mixed_groups(obj):
            logger.info(
                "FSDP2: fused/foreach optimizer kernels off where sharded and plain (expert-LoRA) parameters "
                "share a device (they take one device's tensors in one call; DTensor refuses the mix)"
            )


def _peft_entries(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(PEFT's adapter state dict: file key -> live tensor, the model's ``state_dict()``).

    PEFT chooses the entries and names them (``get_peft_model_state_dict``) but keeps the
    values: the model's ``state_dict()`` tensors, possibly DTensor shards, which share storage
    with the parameters (so copying into them loads the parameters)."""
    from peft import get_peft_model_state_dict

    state = model.state_dict()
    return get_peft_model_state_dict(model, state_dict=state, adapter_name=model.active_adapter), state


def full_adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The PEFT adapter's tensors as whole CPU tensors under the model's own keys (what PEFT's
    ``save_pretrained(state_dict=...)`` filters again). A collective: every rank calls it, and
    walks the keys in the same (sorted) order."""
    chosen, state = _peft_entries(model)
    chosen_ids = {id(v) for v in chosen.values()}
    keys = sorted(k for k, v in state.items() if id(v) in chosen_ids)
    return {k: gather_full(state[k]).detach().cpu() for k in keys}


def save_adapter_dir(trainer: Any, output_dir: str | None) -> None:
    """``Trainer.save_model`` for kt-ft under FSDP2: all ranks gather the adapter, rank 0 writes
    the usual kt-ft adapter dir (through the model's ``save_pretrained``: PEFT files, fused
    expert LoRA, manifest)."""
    output_dir = output_dir if output_dir is not None else trainer.args.output_dir
    state_dict = full_adapter_state_dict(trainer.model)
    if trainer.args.should_save:
        trainer._save(output_dir, state_dict=state_dict)


def save_optimizer_and_scheduler(trainer: Any, output_dir: str) -> None:
    """One whole ``optimizer.pt`` (index-keyed, as one process writes it) and ``scheduler.pt``,
    by rank 0; the optimizer's shards are gathered on all ranks first."""
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    state = full_optimizer_state(trainer.optimizer)
    if trainer.args.should_save:
        torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the scheduler's "save the optimizer too" notice
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_adapter_into_shards(trainer: Any, checkpoint: str) -> None:
    """Resume: check ``checkpoint`` against its manifest (fail closed), copy its PEFT adapter
    into the live shards and its expert LoRA into the CPU experts."""
    from safetensors.torch import load_file

    model = trainer.model
    info = _kt_info(trainer)
    verify_adapter_dir(checkpoint, info)
    path = Path(checkpoint) / ADAPTER_WEIGHTS
    saved = load_file(str(path))
    chosen, _ = _peft_entries(model)
    missing = sorted(set(chosen) - set(saved))
    unexpected = sorted(set(saved) - set(chosen))
    if missing or unexpected:
        raise KTConfigError(
            f"{path}: does not match this model's PEFT adapter: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    problems = []
    for key, target in chosen.items():
        try:
            copy_full_into(target, saved[key])
        except ValueError as e:
            problems.append(f"{path}: key {key}: {e}")
    if problems:
        raise KTConfigError(problems)
    load_kt_adapter_experts(model, checkpoint, info, trainable=True, verify=False)
    logger.info(f"loaded PEFT adapter (into FSDP2 shards) and expert LoRA from {checkpoint}")


def load_optimizer_and_scheduler(trainer: Any, checkpoint: str) -> None:
    """Resume: the whole ``optimizer.pt`` (any process count, DDP, FSDP2 or one process), cut to
    this rank's shards, and ``scheduler.pt``."""
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    opt = os.path.join(checkpoint, OPTIMIZER_NAME)
    sched = os.path.join(checkpoint, SCHEDULER_NAME)
    for f in (opt, sched):
        if not os.path.isfile(f):
            raise KTConfigError(
                f"{f}: missing (kt-ft checkpoints hold one whole optimizer.pt and scheduler.pt)"
            )
    state = torch.load(opt, map_location="cpu", weights_only=True)
    trainer.optimizer.load_state_dict(shard_optimizer_state(state, trainer.optimizer))
    unfuse_mixed_groups(trainer.optimizer)  # load_state_dict restored the saved groups' kernel flags
    trainer.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
