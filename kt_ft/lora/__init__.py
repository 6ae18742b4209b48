"""Expert LoRA in the fused layout (all experts of a layer stacked on dim 0)."""

from .fused import expert_lora_shapes, init_expert_lora, lora_scaling

__all__ = ["expert_lora_shapes", "init_expert_lora", "lora_scaling"]
