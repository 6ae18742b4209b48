"""Split checkpoints: PEFT's adapter_model.safetensors + kt-ft's fused_expert_lora.safetensors."""

from .fused import FUSED_FILE, fused_state_dict, load_fused_expert_lora, save_fused_expert_lora

__all__ = ["FUSED_FILE", "fused_state_dict", "load_fused_expert_lora", "save_fused_expert_lora"]
