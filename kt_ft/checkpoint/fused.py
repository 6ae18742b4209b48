"""``fused_expert_lora.safetensors``: the expert LoRA of every MoE layer, KTransformers' layout.

Keys ``layers.{L}.experts.{gate|up|down}_lora_{a|b}`` (L: decoder-layer index), bf16, all
experts stacked on dim 0: gate/up A [E, r, H], gate/up B [E, I, r], down A [E, r, I],
down B [E, H, r]. Written to a temporary name and renamed, so a crash mid-save never leaves
a truncated file under the real name.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import KTConfigError
from ..kernels.base import LORA_NAMES

FUSED_FILE = "fused_expert_lora.safetensors"
FILE_DTYPE = torch.bfloat16


def _file_key(layer: int, name: str) -> str:
    proj, ab = name.split("_")  # "gate_a" -> ("gate", "a")
    return f"layers.{layer}.experts.{proj}_lora_{ab}"


def kt_expert_modules(model) -> list:
    from ..moe.experts import KTExperts

    return [m for m in model.modules() if isinstance(m, KTExperts)]


def fused_state_dict(model) -> dict[str, torch.Tensor]:
    """File key -> bf16 CPU tensor for every KTExperts module of ``model``."""
    out = {}
    for m in kt_expert_modules(model):
        for name in LORA_NAMES:
            out[_file_key(m.layer_idx, name)] = getattr(m, name).detach().to("cpu", FILE_DTYPE).contiguous()
    return out


def save_fused_expert_lora(model, directory: str | os.PathLike) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / FUSED_FILE
    tmp = directory / f".{FUSED_FILE}.tmp-{os.getpid()}"
    save_file(fused_state_dict(model), str(tmp), metadata={"format": "pt", "producer": "kt-ft"})
    os.replace(tmp, target)
    return target


def load_fused_expert_lora(model, directory: str | os.PathLike) -> int:
    """Copy the expert LoRA from ``directory``'s fused file into the model; return layers loaded.

    Every KTExperts layer must be in the file with the right shapes: anything missing or
    mismatched is an error naming the file and the key, never a silent fresh start.
    """
    path = Path(directory) / FUSED_FILE
    if not path.is_file():
        raise KTConfigError(
            f"{path}: missing (expected kt-ft's expert LoRA beside adapter_model.safetensors)"
        )
    tensors = load_file(str(path))
    problems = []
    modules = kt_expert_modules(model)
    for m in modules:
        for name in LORA_NAMES:
            key = _file_key(m.layer_idx, name)
            param = getattr(m, name)
            if key not in tensors:
                problems.append(f"{path}: key {key} missing")
            elif tuple(tensors[key].shape) != tuple(param.shape):
                problems.append(
                    f"{path}: key {key} has shape {tuple(tensors[key].shape)}, the model needs {tuple(param.shape)}"
                )
    if problems:
        raise KTConfigError(problems)
    with torch.no_grad():
        for m in modules:
            for name in LORA_NAMES:
                getattr(m, name).copy_(tensors[_file_key(m.layer_idx, name)])
            m.runner.backend.lora_updated()
    return len(modules)
