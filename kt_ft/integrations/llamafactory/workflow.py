"""LLaMA-Factory 0.9.5's training entry and workflows with a kt-ft model (hooked by
``kt_ft.integrations.startup`` when they are imported).

* ``llamafactory.train.tuner``: ``_training_function`` builds the callback list; kt-ft appends
  ``KTCallback`` (checkpoint manifest last, ``placement: auto``, run summary) and, when asked by
  ``KT_FT_PROFILE`` / ``KT_FT_RUN_REPORT``, the profiler and host-time callbacks. Each does
  nothing for a model kt-ft did not attach to.
* ``llamafactory.train.sft.workflow`` / ``pt.workflow``: for a ``use_kt`` run, the trainer class
  the workflow instantiates is kt-ft's subclass of it (``kt_trainer_class``: resume on the CPU,
  FSDP2) for the duration of ``run_sft`` / ``run_pt``; no Trainer class is patched. ``run_sft``
  also refuses ``predict_with_generate`` and ``compute_accuracy`` when ``use_kt`` is set (its own
  ``use_kt`` path cannot generate). Once kt-ft is attached to the loaded model, its experts
  generate (no grad, KV cache, batches) like any module: the rest of ``run_sft`` sees
  ``use_kt: false`` (``kt_model_loaded``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kt_ft.integrations.trainer.callback import KTCallback
from kt_ft.integrations.trainer.host_time import host_time_from_env
from kt_ft.integrations.trainer.profile import profiler_from_env
from kt_ft.integrations.trainer.subclass import kt_trainer_class


def patch_tuner_module(tuner: ModuleType) -> None:
    if getattr(tuner, "_kt_ft_patched", False):
        return
    original = tuner._training_function

    def _training_function(config: dict[str, Any]) -> None:
        profiler = profiler_from_env()  # KT_FT_PROFILE: one optimizer step under torch.profiler
        host = host_time_from_env()  # KT_FT_RUN_REPORT: the threads' CPU time a step, unprofiled
        callbacks = [
            *(config.get("callbacks") or []),
            KTCallback(),
            *([profiler] if profiler else []),
            *([host] if host else []),
        ]
        return original({**config, "callbacks": callbacks})

    tuner._training_function = _training_function
    tuner._kt_ft_patched = True


def _with_kt_trainer(workflow: ModuleType, class_name: str, run):
    """``run`` with ``workflow.<class_name>`` (the trainer class it instantiates) swapped for
    kt-ft's subclass of it while it runs, for a ``use_kt`` run only."""

    def wrapped(model_args, *args, **kwargs):
        original = getattr(workflow, class_name, None)
        if not getattr(model_args, "use_kt", False) or original is None:
            return run(model_args, *args, **kwargs)
        setattr(workflow, class_name, kt_trainer_class(original))
        try:
            return run(model_args, *args, **kwargs)
        finally:
            setattr(workflow, class_name, original)

    return wrapped


def patch_pt_workflow_module(workflow: ModuleType) -> None:
    """``run_pt``: a ``use_kt`` run trains with kt-ft's subclass of ``CustomTrainer``."""
    if getattr(workflow, "_kt_ft_patched", False):
        return
    workflow.run_pt = _with_kt_trainer(workflow, "CustomTrainer", workflow.run_pt)
    workflow._kt_ft_patched = True


def patch_sft_workflow_module(workflow: ModuleType) -> None:
    """``run_sft``: a ``use_kt`` run trains with kt-ft's subclass of ``CustomSeq2SeqTrainer``. From
    the moment kt-ft is attached to the loaded model until ``run_sft`` returns,
    ``model_args.use_kt`` reads false, so LLaMA-Factory's refusal of generation and accuracy
    metrics for its own (forked) ``use_kt`` path does not apply to kt-ft's model. Before that
    (tokenizer, dataset, ``load_model``) and after, it is unchanged."""
    if getattr(workflow, "_kt_ft_patched", False):
        return
    original_run_sft = workflow.run_sft
    original_load_model = workflow.load_model

    def load_model(tokenizer, model_args, *args, **kwargs):
        model = original_load_model(tokenizer, model_args, *args, **kwargs)
        if getattr(model_args, "use_kt", False) and getattr(model, "_kt_ft_info", None) is not None:
            model_args.use_kt = False  # kt_model_loaded: restored when run_sft returns
            model_args._kt_ft_use_kt_hidden = True
        return model

    def run_sft(model_args, *args, **kwargs):
        if not getattr(model_args, "use_kt", False):
            return original_run_sft(model_args, *args, **kwargs)
        try:
            return original_run_sft(model_args, *args, **kwargs)
        finally:
            if getattr(model_args, "_kt_ft_use_kt_hidden", False):
                model_args.use_kt = True
                model_args._kt_ft_use_kt_hidden = False

    workflow.load_model = load_model
    workflow.run_sft = _with_kt_trainer(workflow, "CustomSeq2SeqTrainer", run_sft)
    workflow._kt_ft_patched = True
