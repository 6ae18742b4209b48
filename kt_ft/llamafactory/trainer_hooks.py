"""Trainer-side checkpoint hook: the manifest of a checkpoint-N dir is written last.

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

from transformers import TrainerCallback

from ..checkpoint.manifest import write_manifest
from ..distributed import barrier


class KTCheckpointCallback(TrainerCallback):
    """Writes kt_adapter_manifest.json into each checkpoint-N once the Trainer has filled it."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and getattr(model, "_kt_ft_info", None) is not None:
            model._kt_ft_defer_checkpoint_manifest = True  # model.py's save hook leaves it to on_save

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


def patch_tuner_module(tuner: ModuleType) -> None:
    if getattr(tuner, "_kt_ft_patched", False):
        return
    original = tuner._training_function

    def _training_function(config: dict[str, Any]) -> None:
        callbacks = [*(config.get("callbacks") or []), KTCheckpointCallback()]
        return original({**config, "callbacks": callbacks})

    tuner._training_function = _training_function
    tuner._kt_ft_patched = True
