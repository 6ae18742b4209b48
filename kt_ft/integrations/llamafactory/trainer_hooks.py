"""Trainer-side hooks: the checkpoint manifest written last, and placement: auto's start and steps.

The HF Trainer saves a checkpoint as model (adapter + fused expert LoRA, through the
``save_pretrained`` hook of ``model.py``), then optimizer, scheduler, RNG state and
trainer_state.json, then calls ``on_save``. Writing the manifest there, over all of these
files, is what makes "manifest present" mean "checkpoint complete": a SIGKILL anywhere
before leaves a dir every kt-ft loader refuses, and the previous checkpoint untouched.

With several processes, rank 0 alone writes the model, optimizer and manifest (the HF
Trainer's ``should_save``); the other ranks write only their ``rng_state_{rank}.pth``, and
``on_save`` waits for all of them before the manifest hashes the directory.

LLaMA-Factory 0.9.5 builds its callback list in ``llamafactory.train.tuner._training_function``;
``patch_tuner_module`` appends this callback there. It does nothing for models kt-ft did not
attach to (``use_kt: false``).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers import TrainerCallback

from kt_ft.base.log import get_logger
from kt_ft.base.processes import barrier
from kt_ft.formats.manifest import write_manifest
from kt_ft.integrations.llamafactory.fsdp_trainer import patch_trainer_for_fsdp2
from kt_ft.integrations.llamafactory.host_time import host_time_from_env
from kt_ft.integrations.llamafactory.profile import profiler_from_env
from kt_ft.runtime.memory import memory_report
from kt_ft.runtime.run_stats import PhasePeaks, run_summary

logger = get_logger(__name__)


class KTCheckpointCallback(TrainerCallback):
    """Writes kt_adapter_manifest.json into each checkpoint-N once the Trainer has filled it."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and getattr(model, "_kt_ft_info", None) is not None:
            model._kt_ft_defer_checkpoint_manifest = True  # model.py's save hook leaves it to on_save
        replanner = getattr(model, "_kt_ft_replanner", None)
        if replanner is not None:
            # placement: auto predicts the step with the non-expert work as this run does it
            autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
            replanner.measure_non_expert(model, autocast_dtype=autocast)
        if model is not None and getattr(model, "_kt_ft_info", None) is not None:
            model._kt_ft_phase_peaks = PhasePeaks()  # the run summary's peaks by phase
            model._kt_ft_phase_peaks.mark("start")

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        peaks = getattr(model, "_kt_ft_phase_peaks", None)
        if peaks is not None:
            peaks.mark("forward + backward")
        sync = getattr(model, "_kt_ft_grad_sync", None)
        if sync is not None:
            sync.check_complete()  # several processes: the expert-LoRA grads were all averaged

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        peaks = getattr(model, "_kt_ft_phase_peaks", None)
        if peaks is not None:
            peaks.mark("optimizer step")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        replanner = getattr(model, "_kt_ft_replanner", None)
        if replanner is not None:
            replanner.step(state.global_step)  # placement: auto: re-plan when routing drifted

    def on_train_end(self, args, state, control, model=None, **kwargs):
        sync = getattr(model, "_kt_ft_grad_sync", None)
        if sync is not None:
            logger.info(f"expert-LoRA gradients averaged across ranks {sync.reductions} times this run")
        if getattr(model, "_kt_ft_info", None) is not None:
            logger.info(f"run summary: {run_summary(model, state.global_step)}")
            memory_report(model)  # only with KT_FT_MEMORY_REPORT set (scripts/ddp_memory.py)

    def on_save(self, args, state, control, model=None, **kwargs):
        info = getattr(model, "_kt_ft_info", None)
        if info is None:
            return
        # With several processes every rank writes its own rng_state_{rank}.pth, with no barrier
        # before this callback: wait for all of them before rank 0 hashes the directory.
        barrier()
        if not state.is_world_process_zero:
            return
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if directory.is_dir():
            write_manifest(directory, info, with_trainer_state=True)


def patch_optimizer_loading() -> None:
    """Resume: every rank reads the one (unsharded) ``optimizer.pt`` into CPU memory, and
    ``Optimizer.load_state_dict`` moves each state to its parameter's device (expert LoRA: the
    CPU; PEFT LoRA: the GPU). The HF Trainer maps it to ``args.device`` when there are several
    processes: on a CPU run that is ``cpu:0``, a location ``torch.load`` rejects ("don't know how
    to restore data location"), and on a GPU run the expert LoRA's AdamW state would pass
    through the GPU. Only for kt-ft models, and not under DeepSpeed or FSDP (under FSDP2,
    ``fsdp_trainer`` loads the same file into the optimizer's shards)."""
    import os

    import torch
    from transformers import Trainer
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    original = Trainer._load_optimizer_and_scheduler
    if getattr(original, "_kt_ft", False):
        return

    def _load_optimizer_and_scheduler(self, checkpoint):
        opt = os.path.join(checkpoint, OPTIMIZER_NAME) if checkpoint else None
        sched = os.path.join(checkpoint, SCHEDULER_NAME) if checkpoint else None
        if (
            opt is None
            or getattr(self.model, "_kt_ft_info", None) is None
            or self.is_deepspeed_enabled
            or self.is_fsdp_enabled
            or not (os.path.isfile(opt) and os.path.isfile(sched))
        ):
            return original(self, checkpoint)
        self.optimizer.load_state_dict(torch.load(opt, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    _load_optimizer_and_scheduler._kt_ft = True
    Trainer._load_optimizer_and_scheduler = _load_optimizer_and_scheduler


def patch_tuner_module(tuner: ModuleType) -> None:
    if getattr(tuner, "_kt_ft_patched", False):
        return
    patch_optimizer_loading()
    patch_trainer_for_fsdp2()  # wraps the optimizer loading above for kt-ft models under FSDP2
    original = tuner._training_function

    def _training_function(config: dict[str, Any]) -> None:
        profiler = profiler_from_env()  # KT_FT_PROFILE: one optimizer step under torch.profiler
        host = host_time_from_env()  # KT_FT_HOST_TIME: the threads' CPU time a step, unprofiled
        callbacks = [
            *(config.get("callbacks") or []),
            KTCheckpointCallback(),
            *([profiler] if profiler else []),
            *([host] if host else []),
        ]
        return original({**config, "callbacks": callbacks})

    tuner._training_function = _training_function
    tuner._kt_ft_patched = True
