"""The HF Trainer for a kt-ft model: a subclass of whichever Trainer class a run uses
(``transformers.Trainer``, LLaMA-Factory's ``CustomSeq2SeqTrainer``, ...), made per run by
``kt_trainer_class``; ``transformers.Trainer`` itself is never patched.

What it changes, only for a model kt-ft attached to (``_kt_ft_info``), each method otherwise the
base class's own:

* **Resume on the CPU.** Every rank reads the one (unsharded) ``optimizer.pt`` into CPU memory
  and ``Optimizer.load_state_dict`` moves each state to its parameter's device (expert LoRA: the
  CPU; PEFT LoRA: the GPU). The HF Trainer maps it to ``args.device`` when there are several
  processes: on a CPU run that is ``cpu:0``, a location ``torch.load`` rejects ("don't know how to
  restore data location"), and on a GPU run the expert LoRA's AdamW state would pass through the
  GPU. Not under DeepSpeed or FSDP1.
* **FSDP2** (``fsdp.py``): the routed experts kept out of ``fully_shard``, the clipping, and
  checkpoints in kt-ft's usual layout (one whole adapter and ``optimizer.pt``).
"""

from __future__ import annotations

import functools
import os

import torch

from kt_ft.integrations.trainer.fsdp import (
    kt_fsdp2,
    load_adapter_into_shards,
    load_optimizer_and_scheduler,
    save_adapter_dir,
    save_optimizer_and_scheduler,
    setup_fsdp2,
)


class KTTrainerMixin:
    """The overrides (module doc); put first in the bases, before the Trainer class."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        setup_fsdp2(self)  # a no-op without kt-ft or without FSDP2

    def save_model(self, output_dir=None, _internal_call=False):
        if not kt_fsdp2(self):
            return super().save_model(output_dir, _internal_call)
        return save_adapter_dir(self, output_dir)

    def _save_optimizer_and_scheduler(self, output_dir):
        if not kt_fsdp2(self):
            return super()._save_optimizer_and_scheduler(output_dir)
        return save_optimizer_and_scheduler(self, output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not kt_fsdp2(self):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        return load_adapter_into_shards(self, resume_from_checkpoint)

    def _load_best_model(self):
        if not kt_fsdp2(self):
            return super()._load_best_model()
        return load_adapter_into_shards(self, self.state.best_model_checkpoint)  # load_best_model_at_end

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None and kt_fsdp2(self):
            return load_optimizer_and_scheduler(self, checkpoint)
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        opt = os.path.join(checkpoint, OPTIMIZER_NAME) if checkpoint else None
        sched = os.path.join(checkpoint, SCHEDULER_NAME) if checkpoint else None
        if (
            opt is None
            or getattr(self.model, "_kt_ft_info", None) is None
            or self.is_deepspeed_enabled
            or self.is_fsdp_enabled
            or not (os.path.isfile(opt) and os.path.isfile(sched))
        ):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.optimizer.load_state_dict(torch.load(opt, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


@functools.cache
def kt_trainer_class(base: type) -> type:
    """``base`` (an HF Trainer class) with kt-ft's overrides: ``KT<base name>``, one class per base."""
    if issubclass(base, KTTrainerMixin):
        return base
    return type(
        f"KT{base.__name__}", (KTTrainerMixin, base), {"__module__": __name__, "__doc__": base.__doc__}
    )
