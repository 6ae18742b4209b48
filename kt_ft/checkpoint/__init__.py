"""Split checkpoints: PEFT's adapter_model.safetensors + kt-ft's fused_expert_lora.safetensors,
with a manifest written last (``manifest``), every file landing by atomic rename (``atomic``)."""

from .fused import FUSED_FILE, MASTER_FILE, fused_state_dict, load_fused_expert_lora, save_fused_expert_lora
from .manifest import (
    MANIFEST_FILE,
    KTAdapterInfo,
    base_config_sha256,
    info_from_manifest,
    read_manifest,
    verify_adapter_dir,
    write_manifest,
)
from .save import load_kt_adapter_experts, save_kt_adapter

__all__ = [
    "FUSED_FILE",
    "MASTER_FILE",
    "MANIFEST_FILE",
    "KTAdapterInfo",
    "base_config_sha256",
    "fused_state_dict",
    "info_from_manifest",
    "load_fused_expert_lora",
    "load_kt_adapter_experts",
    "read_manifest",
    "save_fused_expert_lora",
    "save_kt_adapter",
    "verify_adapter_dir",
    "write_manifest",
]
