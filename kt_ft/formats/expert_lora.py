"""``fused_expert_lora.safetensors``: the expert LoRA of every MoE layer, KTransformers' layout.

Keys ``layers.{L}.experts.{gate|up|down}_lora_{a|b}`` (L: decoder-layer index), all experts
stacked on dim 0: gate/up A [E, r, H], gate/up B [E, I, r], down A [E, r, I], down B [E, H, r].
bf16, as KTransformers' tooling writes and reads it. The expert LoRA trains in fp32, and a
resume must continue from exactly the weights its optimizer state belongs to, so the same
tensors in their training dtype go beside it as ``kt_expert_lora_master.safetensors``; loading
prefers that file and falls back to the bf16 one (e.g. an adapter from KTransformers). Both
are written to a temporary name and renamed, so a crash mid-save never leaves a truncated
file under the real name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from kt_ft.base.atomic import atomic_path
from kt_ft.base.errors import KTConfigError

FUSED_FILE = "fused_expert_lora.safetensors"
MASTER_FILE = "kt_expert_lora_master.safetensors"
FILE_DTYPE = torch.bfloat16


def fused_key(layer: int, name: str) -> str:
    """File key of LoRA tensor ``name`` (e.g. ``gate_a``) of decoder layer ``layer``."""
    proj, ab = name.split("_")  # "gate_a" -> ("gate", "a")
    return f"layers.{layer}.experts.{proj}_lora_{ab}"


def save_expert_lora_files(
    directory: str | os.PathLike, tensors: Callable[[torch.dtype | None], dict]
) -> Path:
    """Write the bf16 fused file and the training-dtype master copy, each by an atomic rename;
    ``tensors(dtype)`` gives file key -> CPU tensor in ``dtype`` (None: the training dtype).
    Returns the fused file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "producer": "kt-ft"}
    for name, dtype in ((MASTER_FILE, None), (FUSED_FILE, FILE_DTYPE)):
        with atomic_path(directory / name) as tmp:
            save_file(tensors(dtype), str(tmp), metadata=meta)
    return directory / FUSED_FILE


def fused_header(path: str | os.PathLike) -> dict[str, dict]:
    """Key -> {"shape": [...], "dtype": "F32"} read from the safetensors header (no tensor data)."""
    try:
        with safe_open(str(path), "pt") as f:
            return {
                k: {"shape": list(f.get_slice(k).get_shape()), "dtype": f.get_slice(k).get_dtype()}
                for k in sorted(f.keys())
            }
    except (SafetensorError, OSError, ValueError) as e:
        raise KTConfigError(f"{path}: not a readable safetensors file ({e})") from e


def expert_lora_file(directory: str | os.PathLike) -> Path:
    """The file to read the expert LoRA from: the training-dtype master copy if present, else
    the bf16 fused file (which may not exist: callers report that)."""
    master = Path(directory) / MASTER_FILE
    return master if master.is_file() else Path(directory) / FUSED_FILE


def read_expert_lora_files(
    directory: str | os.PathLike, expected: dict[str, tuple[tuple[int, ...], str]]
) -> dict[str, torch.Tensor]:
    """The expert LoRA of ``directory``: the training-dtype master copy when present (exact
    resume), else the bf16 fused file. ``expected``: file key -> (shape, what the shape belongs
    to, for the message). Anything missing or mismatched is an error naming the file and the
    key, never a silent fresh start."""
    path = expert_lora_file(directory)
    if not path.is_file():
        raise KTConfigError(
            f"{path}: missing (expected kt-ft's expert LoRA beside adapter_model.safetensors)"
        )
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise KTConfigError(f"{path}: not a readable safetensors file ({e}); truncated?") from e
    problems = []
    for key, (shape, owner) in expected.items():
        if key not in tensors:
            problems.append(f"{path}: key {key} missing")
        elif tuple(tensors[key].shape) != tuple(shape):
            problems.append(
                f"{path}: key {key} has shape {tuple(tensors[key].shape)}, the model needs {tuple(shape)} ({owner})"
            )
    if problems:
        raise KTConfigError(problems)
    return tensors
