"""Read a kt-ft adapter dir (checked against its manifest) for the exporters."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kt_ft.base.errors import KTConfigError
from kt_ft.formats.expert_lora import expert_lora_file, fused_key
from kt_ft.formats.lora_layout import lora_scaling
from kt_ft.formats.manifest import KTAdapterInfo, info_from_manifest, verify_adapter_dir

PEFT_PREFIX = "base_model.model."
PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass
class KTAdapter:
    """One adapter dir in memory.

    ``peft_config``: adapter_config.json without kt-ft's block; ``peft_tensors``: PEFT's keys
    (``base_model.model.<module>.lora_{A|B}.weight``); ``fused``: fused-file keys
    ``layers.{L}.experts.{proj}_lora_{a|b}`` ([E, r, in] / [E, out, r]); ``targets``: decoder
    layer index -> dotted name of its experts module in the base model.
    """

    path: Path
    info: KTAdapterInfo
    peft_config: dict
    peft_tensors: dict[str, torch.Tensor]
    fused: dict[str, torch.Tensor]
    targets: dict[int, str]

    @property
    def scaling(self) -> float:
        return lora_scaling(rank=self.info.rank, alpha=self.info.alpha, use_rslora=self.info.use_rslora)

    def expert_lora(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [E, r, in], B [E, out, r]) of ``proj`` in gate, up, down."""
        return self.fused[fused_key(layer, f"{proj}_a")], self.fused[fused_key(layer, f"{proj}_b")]


def read_kt_adapter(directory: str | os.PathLike) -> KTAdapter:
    directory = Path(directory)
    manifest = verify_adapter_dir(directory)  # sizes and sha256 of every file, before reading any
    info = info_from_manifest(manifest)
    config = json.loads((directory / "adapter_config.json").read_text())
    config.pop("kt_ft", None)
    unsupported = {k: config.get(k) for k in ("use_dora", "modules_to_save", "lora_bias") if config.get(k)}
    if config.get("peft_type") != "LORA" or unsupported:
        raise KTConfigError(
            f"{directory / 'adapter_config.json'}: peft_type={config.get('peft_type')!r} {unsupported}: "
            "kt-ft exports plain LoRA only"
        )
    if len(info.targets) != len(info.layers):
        raise KTConfigError(f"{directory}: manifest experts.targets and experts.layers differ in length")
    return KTAdapter(
        path=directory,
        info=info,
        peft_config=config,
        peft_tensors=load_file(str(directory / "adapter_model.safetensors")),
        fused=load_file(str(expert_lora_file(directory))),
        targets=dict(zip(info.layers, info.targets, strict=True)),
    )
