"""The HF Trainer callback of a kt-ft run: the checkpoint manifest written last, placement: auto's
start and steps, and the run's summary.

The HF Trainer saves a checkpoint as model (adapter + fused expert LoRA, through the
``save_pretrained`` hook of ``model.py``), then optimizer, scheduler, RNG state and
trainer_state.json, then calls ``on_save``. Writing the manifest there, over all of these
files, is what makes "manifest present" mean "checkpoint complete": a SIGKILL anywhere
before leaves a dir every kt-ft loader refuses, and the previous checkpoint untouched.

With several processes, rank 0 alone writes the model, optimizer and manifest (the HF
Trainer's ``should_save``); the other ranks write only their ``rng_state_{rank}.pth``, and
``on_save`` waits for all of them before the manifest hashes the directory.

Any HF Trainer takes it: ``Trainer(model=..., callbacks=[KTCallback()])`` after ``kt_ft.apply``;
the LLaMA-Factory layer appends it to the callbacks of every run
(``kt_ft.integrations.llamafactory.workflow``). It does nothing for models kt-ft did not attach
to (``use_kt: false``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from kt_ft.base.log import get_logger
from kt_ft.base.processes import barrier
from kt_ft.formats.manifest import write_manifest
from kt_ft.integrations.trainer.preempt import Preemption
from kt_ft.runtime.memory import memory_report
from kt_ft.runtime.run_stats import PhasePeaks, run_summary

logger = get_logger(__name__)


class KTCallback(TrainerCallback):
    """Writes kt_adapter_manifest.json into each checkpoint-N once the Trainer has filled it; steps
    ``placement: auto``'s re-planner; logs the run's summary at its end."""

    def __init__(self) -> None:
        self._preempt: Preemption | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and getattr(model, "_kt_ft_info", None) is not None:
            model._kt_ft_defer_checkpoint_manifest = (
                True  # runtime/adapter.py's save hook leaves it to on_save
            )
            self._preempt = Preemption()  # SIGTERM / SIGINT: finish the step, save, exit (preempt.py)
            if not self._preempt.install():
                self._preempt = None
        run = getattr(model, "_kt_ft_run", None)
        replanner = run.replanner if run is not None else None
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
        run = getattr(model, "_kt_ft_run", None)
        if run is not None:
            run.step(state.global_step)  # placement: auto: re-plan when routing drifted
        if self._preempt is not None and self._preempt.requested:
            control.should_save = True  # this step's checkpoint, then on_save exits
            control.should_training_stop = True

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self._preempt is not None:
            self._preempt.restore()
        sync = getattr(model, "_kt_ft_grad_sync", None)
        if sync is not None:
            logger.info(f"expert-LoRA gradients averaged across ranks {sync.reductions} times this run")
        if getattr(model, "_kt_ft_info", None) is not None:
            logger.info(f"run summary: {run_summary(model, state.global_step)}")
            # only with KT_FT_RUN_REPORT set (python -m kt_ft.integrations.bench.probes.ddp_memory)
            memory_report(model)

    def on_save(self, args, state, control, model=None, **kwargs):
        info = getattr(model, "_kt_ft_info", None)
        if info is None:
            return
        # With several processes every rank writes its own rng_state_{rank}.pth, with no barrier
        # before this callback: wait for all of them before rank 0 hashes the directory.
        barrier()
        preempted = self._preempt is not None and self._preempt.requested
        if not state.is_world_process_zero:
            if preempted:  # the signal reached every rank (torchrun passes it on): all stop here
                raise SystemExit(self._preempt.exit_code())
            return
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if directory.is_dir():
            write_manifest(directory, info, with_trainer_state=True)
        if preempted:
            logger.warning(
                f"preempted: {directory} is complete (manifest written); resume from it with "
                f"resume_from_checkpoint: {directory}, or the same command with overwrite_output_dir: false"
            )
            raise SystemExit(self._preempt.exit_code())
