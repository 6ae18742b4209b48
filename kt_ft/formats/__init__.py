"""What kt-ft reads and writes on disk, with no model code: the expert-LoRA file
(``fused_expert_lora.safetensors``) and its layout, the adapter manifest, a model's files (its
meta skeleton from ``config.json``, where each routed expert's bytes lie in the safetensors).
"""
