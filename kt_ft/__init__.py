"""kt-ft: LoRA fine-tuning of Mixture-of-Experts LLMs with routed experts on the CPU.

This module is imported at interpreter start-up (through ``kt_ft_activate.pth``), so it must
stay free of heavy imports: no torch, no transformers here.
"""

from .base.version import __version__

__all__ = ["KTConfig", "KTRun", "__version__", "apply"]


def __getattr__(name: str):
    """``kt_ft.apply`` / ``KTConfig`` / ``KTRun`` (``kt_ft/runtime/core.py``), imported on first use only:
    the start-up hook imports this package in every Python process."""
    if name in ("KTConfig", "KTRun", "apply"):
        from kt_ft.runtime import core  # why: torch and the model code load on first use, not at start-up

        return getattr(core, name)
    raise AttributeError(f"module 'kt_ft' has no attribute {name!r}")
