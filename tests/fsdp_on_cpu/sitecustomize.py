"""Test-only: let accelerate run FSDP on a CPU-only multi-process (gloo) run.

accelerate 1.11 (``AcceleratorState.__init__``) turns an FSDP plugin into
``DistributedType.FSDP`` only for GPU-like multi-device types; on ``MULTI_CPU`` it drops the
plugin silently and the run trains with DDP. torch's ``fully_shard`` itself works on CPU over
gloo, so on CI (no GPU) this shim lifts accelerate's device gate, and nothing else: the HF
Trainer, accelerate's ``fsdp2_prepare_model``, its FSDP checkpoint code and kt-ft then run as on
GPUs. ``tests/test_fsdp.py`` puts this directory first on the training subprocesses'
PYTHONPATH; never installed, never imported by kt-ft.
"""

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

_original_init = AcceleratorState.__init__


def _init(self, *args, fsdp_plugin=None, **kwargs):
    _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        # what accelerate's GPU branch does
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _init
