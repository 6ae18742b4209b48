"""The HF Trainer with kt-ft: the run's callback (``KTCallback``) and a per-run subclass of the
Trainer class (``kt_trainer_class``) for resume on the CPU and FSDP2; neither changes a run
kt-ft did not attach to.

    run = kt_ft.apply(model, kt_ft.KTConfig(...))
    trainer = kt_trainer_class(Trainer)(model=model, args=..., callbacks=[KTCallback()])
"""

from kt_ft.integrations.trainer.callback import KTCallback
from kt_ft.integrations.trainer.subclass import kt_trainer_class

__all__ = ["KTCallback", "kt_trainer_class"]
