"""kt-ft: LoRA fine-tuning of Mixture-of-Experts LLMs with routed experts on the CPU.

This module is imported at interpreter start-up (through ``kt_ft_activate.pth``), so it must
stay free of heavy imports: no torch, no transformers here.
"""

__version__ = "0.1.0"
