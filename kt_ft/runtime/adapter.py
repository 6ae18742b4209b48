"""Save and load a kt-ft adapter directory: PEFT's files + the fused expert LoRA + the manifest.

Order of a save (each file lands by an atomic rename, see ``atomic``):

1. the old manifest is removed: from here on the directory is visibly incomplete;
2. PEFT writes adapter_config.json / adapter_model.safetensors into a hidden temporary dir;
   kt-ft adds its ``kt_ft`` block to the config; the files are renamed into place;
3. fused_expert_lora.safetensors (``kt_ft.formats.expert_lora``; the model's side here);
4. the manifest (for a trainer checkpoint-N, only after the optimizer / scheduler / RNG /
   trainer state: the trainer callback writes it, see ``kt_ft.integrations.trainer.callback``).

A checkpoint-N dir that a crash interrupted has no manifest, and every loader refuses it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kt_ft.backends.base import lora_changed
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.base.version import __version__
from kt_ft.formats.expert_lora import FILE_DTYPE, fused_key, read_expert_lora_files, save_expert_lora_files
from kt_ft.formats.lora_layout import LORA_NAMES
from kt_ft.formats.manifest import (
    CHECKPOINT_DIR,
    MANIFEST_FILE,
    KTAdapterInfo,
    base_config_sha256,
    verify_adapter_dir,
    write_manifest,
)
from kt_ft.runtime.experts import KTExperts

ADAPTER_CONFIG = "adapter_config.json"
logger = get_logger(__name__)

# kt-ft adds a "kt_ft" block to PEFT's adapter_config.json; PEFT ignores it but warns, wrongly,
# that the file may come from a newer PEFT. Silence exactly that warning in kt-ft processes.
warnings.filterwarnings("ignore", message=r"Unexpected keyword arguments \['kt_ft'\]", category=UserWarning)


def adapter_info(
    model: Any,
    *,
    base_model: str | None,
    rank: int,
    alpha: float,
    use_rslora: bool,
    summary: Any,
    plan: Any,
    rule_path: Path,
) -> KTAdapterInfo:
    """What an adapter of this run is for (the manifest's content): the base model (its
    config.json's sha256 where ``base_model``, or the model's own ``name_or_path``, is a local dir
    or a cached hub id; empty for a model built from a config), the expert LoRA's shape, and
    where its experts are."""
    base = base_model or getattr(getattr(model, "config", None), "name_or_path", "") or ""
    try:
        sha = base_config_sha256(base) if base else ""
    except (KTConfigError, OSError, ValueError):
        if base_model:  # asked for by name: a missing config is the caller's mistake
            raise
        sha = ""
    return KTAdapterInfo(
        base_model=str(base),
        base_config_sha256=sha,
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        layers=summary.layers,
        num_experts=summary.num_experts,
        targets=[p.name.removeprefix("base_model.model.") for p in plan.experts],
        backend=summary.backend,
        rule=str(rule_path),
        kt_ft_version=__version__,
        base_format=summary.base_format,
    )


def kt_expert_modules(model) -> list:
    return [m for m in model.modules() if isinstance(m, KTExperts)]


def fused_state_dict(model, dtype: torch.dtype | None = FILE_DTYPE) -> dict[str, torch.Tensor]:
    """File key -> CPU tensor in ``dtype`` (None: the parameter's own) for every KTExperts module."""
    out = {}
    for m in kt_expert_modules(model):
        for name in LORA_NAMES:
            t = getattr(m, name).detach().to("cpu")
            out[fused_key(m.layer_idx, name)] = (t if dtype is None else t.to(dtype)).contiguous()
    return out


def save_fused_expert_lora(model, directory: str | os.PathLike) -> Path:
    """Write the model's expert LoRA (``kt_ft.formats.expert_lora``); return the fused file's path."""
    return save_expert_lora_files(directory, lambda dtype: fused_state_dict(model, dtype))


def load_fused_expert_lora(model, directory: str | os.PathLike) -> int:
    """Copy the expert LoRA from ``directory`` into the model; return layers loaded.

    Reads the training-dtype master copy when present (exact resume), else the bf16 fused file.
    Every KTExperts layer must be in the file with the right shapes (``read_expert_lora_files``).
    """
    modules = kt_expert_modules(model)
    expected = {
        fused_key(m.layer_idx, name): (tuple(getattr(m, name).shape), f"LoRA rank {m.rank}")
        for m in modules
        for name in LORA_NAMES
    }
    tensors = read_expert_lora_files(directory, expected)
    with torch.no_grad():
        for m in modules:
            for name in LORA_NAMES:
                getattr(m, name).copy_(tensors[fused_key(m.layer_idx, name)])
            m.runner.backend.lora_updated()
    lora_changed()  # every cached form of the LoRA (``kt_ft/backends/base.py`` ``lora_key``)
    return len(modules)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_kt_adapter(
    model: Any,
    directory: str | os.PathLike,
    info: KTAdapterInfo,
    peft_save: Callable[..., Any],
    *args: Any,
    with_manifest: bool = True,
    **kwargs: Any,
) -> Any:
    """``peft_save(dir, *args, **kwargs)`` (PEFT's save_pretrained) made crash-safe, plus the
    fused expert LoRA and (``with_manifest``) the manifest. Returns what ``peft_save`` returned."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_FILE).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".kt-ft-save-") as tmp:
        tmp = Path(tmp)
        result = peft_save(str(tmp), *args, **kwargs)
        config = tmp / ADAPTER_CONFIG
        if config.is_file():
            data = json.loads(config.read_text())
            data["kt_ft"] = info.config_block()
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        for src in sorted(tmp.iterdir()):
            dst = directory / src.name
            if src.is_dir():  # PEFT writes one sub-dir per extra adapter
                shutil.copytree(src, dst, dirs_exist_ok=True)
                continue
            _fsync(src)
            os.replace(src, dst)
    save_fused_expert_lora(model, directory)
    if with_manifest:
        write_manifest(directory, info, with_trainer_state=False)
    return result


def load_kt_adapter_experts(
    model: Any, directory: str | os.PathLike, expected: KTAdapterInfo, trainable: bool, verify: bool = True
) -> dict | None:
    """Verify ``directory`` against its manifest and ``expected``, then load the expert LoRA.

    Fails closed (KTConfigError naming the file and the mismatch) before touching the model.
    ``trainable`` sets requires_grad of the expert LoRA: PEFT's adapter loading only manages
    params named ``lora_``, and kt-ft's (gate_a, ...) are deliberately not.
    """
    manifest = verify_adapter_dir(directory, expected) if verify else None
    load_fused_expert_lora(model, directory)
    for m in kt_expert_modules(model):
        for p in m.lora_tensors():
            p.requires_grad_(trainable)
    return manifest


def hook_save_pretrained(model: Any, info: KTAdapterInfo) -> None:
    """Make ``model.save_pretrained`` (what the Trainer calls for every checkpoint and the final
    output) crash-safe and make it write the fused expert LoRA and the manifest too.

    In a trainer's checkpoint-N dir the manifest waits for the optimizer and trainer state
    (``KTCallback.on_save`` writes it) when that callback runs in this training."""
    original = model.save_pretrained
    if getattr(original, "_kt_ft", False):
        return

    @functools.wraps(original)
    def save_pretrained(save_directory, *args, **kwargs):
        if not kwargs.get("is_main_process", True):
            return original(save_directory, *args, **kwargs)
        from peft import PeftModel

        if not isinstance(model, PeftModel):
            # PEFT's part merged (e.g. `llamafactory-cli export`), but a full save would write the
            # expert LoRA as stray tensors that loaders drop, silently: refuse, point to the tool.
            raise KTConfigError(
                f"export to {save_directory} with use_kt: a full save (LLaMA-Factory's export) cannot fold the "
                "expert LoRA; run `kt-ft merge ADAPTER_DIR OUT` (merged model) or `kt-ft convert ADAPTER_DIR OUT` "
                "(per-expert LoRA)"
            )
        defer = getattr(model, "_kt_ft_defer_checkpoint_manifest", False) and bool(
            CHECKPOINT_DIR.fullmatch(Path(save_directory).name)
        )
        return save_kt_adapter(
            model, save_directory, info, original, *args, with_manifest=not defer, **kwargs
        )

    save_pretrained._kt_ft = True
    model.save_pretrained = save_pretrained


def hook_load_adapter(model: Any, info: KTAdapterInfo, experts_trainable: bool = True) -> None:
    """The HF Trainer resumes a PEFT model with ``model.load_adapter(checkpoint_dir, name,
    is_trainable=True)`` before it loads the optimizer state: check the checkpoint against its
    manifest first (fail closed), let PEFT load its part, then load the expert LoRA and keep it
    trainable (PEFT only manages ``lora_`` params) unless the run froze it (``experts_trainable``
    False: a vision-language recipe with ``freeze_language_model``)."""
    original = getattr(model, "load_adapter", None)
    if original is None or getattr(original, "_kt_ft", False):
        return

    @functools.wraps(original)
    def load_adapter(model_id, adapter_name, *args, **kwargs):
        is_trainable = kwargs.get("is_trainable", args[0] if args else False)
        verify_adapter_dir(model_id, info)
        result = original(model_id, adapter_name, *args, **kwargs)
        trainable = bool(is_trainable) and experts_trainable
        load_kt_adapter_experts(model, model_id, info, trainable=trainable, verify=False)
        logger.info(f"resumed expert LoRA from {Path(model_id)} (manifest, sizes and sha256 checked)")
        return result

    load_adapter._kt_ft = True
    model.load_adapter = load_adapter
