"""``kt-ft convert DIR OUT [--split]``: the fused expert LoRA as per-expert PEFT keys.

Expert e of the layer whose experts module is ``T`` (e.g. ``model.layers.3.mlp.experts``) gets
``base_model.model.T.{e}.{gate|up|down}_proj.lora_A.weight`` = fused A[e] [r, in] and
``...lora_B.weight`` = fused B[e] [out, r]: the layout of a PEFT LoRA on a per-expert model
(ModuleList of gate_proj/up_proj/down_proj nn.Linear), which vLLM and SGLang load. Same r and
alpha, so the same scaling. The non-expert PEFT keys are copied unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kt_ft.base.atomic import atomic_path, write_json_atomic
from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.export.adapter import PEFT_PREFIX, PROJ, KTAdapter, read_kt_adapter

EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")


def per_expert_tensors(adapter: KTAdapter) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor for every expert of every layer (copies: safetensors refuses views)."""
    out = {}
    for layer, target in tqdm(
        sorted(adapter.targets.items()), desc="experts -> per-expert LoRA", unit="layer"
    ):
        for proj, module in PROJ.items():
            a, b = adapter.expert_lora(layer, proj)  # [E, r, in], [E, out, r]
            for e in range(a.shape[0]):
                stem = f"{PEFT_PREFIX}{target}.{e}.{module}"
                out[f"{stem}.lora_A.weight"] = a[e].clone()
                out[f"{stem}.lora_B.weight"] = b[e].clone()
    return out


def _config(adapter: KTAdapter, modules: list[str]) -> dict:
    config = dict(adapter.peft_config)
    config["target_modules"] = sorted(set(modules))
    config["inference_mode"] = True
    return config


def _write(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_path(directory / "adapter_model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "kt-ft convert"})
    write_json_atomic(directory / "adapter_config.json", config)


def convert_adapter(src: str | os.PathLike, out: str | os.PathLike, split: bool = False) -> list[Path]:
    """Write OUT (one adapter: experts + the rest) or, with ``split``, OUT/experts and
    OUT/non_experts. Returns the directories written."""
    adapter = read_kt_adapter(src)
    out = Path(out)
    experts = per_expert_tensors(adapter)
    base_modules = list(adapter.peft_config.get("target_modules") or [])
    if isinstance(adapter.peft_config.get("target_modules"), str):
        raise KTConfigError(
            f"{src}/adapter_config.json: target_modules is a regex; convert needs a list of module names"
        )
    if split:
        parts = {
            out / "experts": (_config(adapter, list(EXPERT_MODULES)), experts),
            out / "non_experts": (_config(adapter, base_modules), adapter.peft_tensors),
        }
    else:
        parts = {
            out: (_config(adapter, base_modules + list(EXPERT_MODULES)), {**adapter.peft_tensors, **experts})
        }
    for directory, (config, tensors) in parts.items():
        _write(directory, config, tensors)
    return list(parts)
