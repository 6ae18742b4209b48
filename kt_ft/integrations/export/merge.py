"""``kt-ft merge DIR OUT [--base PATH]``: fold the adapter into the base weights.

W' = W + s * B @ A for every PEFT LoRA module and every expert (s = alpha / r, or
alpha / sqrt(r) with rsLoRA), computed in fp32 and cast back to W's dtype. The base model's
safetensors shards are streamed one at a time (one shard plus the adapter in RAM) and written
under the same names, so its index file stays valid; config, tokenizer and other files are
copied. Experts may be stored per expert (``{T}.{e}.gate_proj.weight`` [I, H], as hub
checkpoints are) or fused (``{T}.gate_up_proj`` [E, 2I, H], ``{T}.down_proj`` [E, H, I], or
transposed, [E, H, 2I] / [E, I, H], as Qwen3-VL-MoE's hub checkpoints are: ``_fold``); ``T`` is
the experts module's name in the trained model (``model.language_model.layers.L.mlp.experts`` for a
vision-language model); for
gpt_oss (the base's config.json says the family) fused in its own layout: ``{T}.gate_up_proj``
[E, H, 2I] with gate/up interleaved (columns 0::2 gate, 1::2 up) and ``{T}.down_proj``
[E, I, H], so the deltas are transposed and interleaved to match; its biases have no LoRA and
are copied. A base kt-ft read quantized (fp8 / int4 / int8 / mxfp4, ``kt_ft.backends.quant``; gpt-oss's
MXFP4 ``gate_up_proj_blocks`` / ``_scales`` as the hub checkpoints ship, also without a
``quantization_config``) is refused: folding W + s*B@A and re-quantizing would round most of the
update away; ``kt-ft dequantize`` it first (its output is accepted as the base of an adapter
trained on the quantized checkpoint), or keep the adapter separate for serving.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kt_ft.backends.quant import FORMATS
from kt_ft.backends.quant_detect import detect_format
from kt_ft.base.atomic import atomic_path, sha256_file
from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.export.adapter import PEFT_PREFIX, PROJ, KTAdapter, read_kt_adapter
from kt_ft.integrations.export.quantize import DEQUANTIZED_FROM
from kt_ft.plan.families import FAMILIES

Delta = Callable[[], torch.Tensor]  # computed lazily, when its shard is written


def _peft_deltas(adapter: KTAdapter) -> dict[str, Delta]:
    """Base weight key -> s * B @ A for each PEFT LoRA module ([out, in])."""
    s = adapter.scaling
    out = {}
    for key, a in adapter.peft_tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = adapter.peft_tensors[key.replace(".lora_A.", ".lora_B.")]
        out[f"{module}.weight"] = lambda a=a, b=b: s * (b.float() @ a.float())
    unknown = [k for k in adapter.peft_tensors if not (".lora_A." in k or ".lora_B." in k)]
    if unknown:
        raise KTConfigError(
            f"{adapter.path}/adapter_model.safetensors: keys merge cannot fold: {unknown[:5]}"
        )
    return out


def _gpt_oss_deltas(lora: dict, s: float) -> tuple[Delta, Delta]:
    """(gate_up [E, H, 2I] interleaved, down [E, I, H]) deltas in gpt_oss's layout."""

    def delta(p: str) -> torch.Tensor:  # s * B @ A transposed to the x @ W layout: [E, in, out]
        return s * torch.bmm(lora[p][1].float(), lora[p][0].float()).transpose(1, 2)

    def gate_up() -> torch.Tensor:
        g, u = delta("gate"), delta("up")  # [E, H, I] each
        return torch.stack([g, u], dim=-1).flatten(-2)  # columns g0, u0, g1, u1, ...

    return gate_up, lambda: delta("down").contiguous()


def _expert_deltas(adapter: KTAdapter, names: set[str], layout: str = "fused_silu") -> dict[str, Delta]:
    """Base key -> delta for every expert, per-expert or fused, whichever the base stores;
    ``layout``: the family's expert layout (``MoEFamily.expert_layout``) for fused keys."""
    s = adapter.scaling
    out = {}
    for layer, target in adapter.targets.items():
        lora = {p: adapter.expert_lora(layer, p) for p in PROJ}  # A [E, r, in], B [E, out, r]

        def fused(*projs, lora=lora):
            return s * torch.cat([torch.bmm(lora[p][1].float(), lora[p][0].float()) for p in projs], dim=1)

        if f"{target}.gate_up_proj_blocks" in names:
            raise KTConfigError(
                f"{adapter.path}: the base model stores {target} MXFP4-quantized (gate_up_proj_blocks / _scales, "
                "as the gpt-oss hub checkpoints do); merge folds the LoRA into bf16/fp32 weights only: "
                "`kt-ft dequantize` the base (with its quantization_config) and merge with --base on that copy, "
                "or use `kt-ft convert` and apply the adapter at inference"
            )
        if layout == "gpt_oss" and f"{target}.gate_up_proj" in names:
            out[f"{target}.gate_up_proj"], out[f"{target}.down_proj"] = _gpt_oss_deltas(lora, s)
            continue
        if f"{target}.gate_up_proj" in names:
            out[f"{target}.gate_up_proj"] = lambda f=fused: f("gate", "up")  # [E, 2I, H], gate rows first
            out[f"{target}.down_proj"] = lambda f=fused: f("down")  # [E, H, I]
            continue
        for proj, module in PROJ.items():
            a, b = lora[proj]
            for e in range(a.shape[0]):
                out[f"{target}.{e}.{module}.weight"] = lambda a=a[e], b=b[e]: s * (b.float() @ a.float())
    return out


def _fold(file: Path, key: str, weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``weight + delta`` in fp32, cast back to the weight's dtype. A fused expert tensor stored
    transposed ([E, in, out]: the Qwen3-VL-MoE hub files' ``gate_up_proj`` [E, H, 2I] and
    ``down_proj`` [E, I, H], which transformers transposes while loading) gets the delta transposed
    the same way; where both orientations have the same shape the file is read as it is, as
    transformers does."""
    if weight.shape != delta.shape and weight.dim() == 3 and weight.shape == delta.transpose(1, 2).shape:
        delta = delta.transpose(1, 2)
    if weight.shape != delta.shape:
        raise KTConfigError(
            f"{file}: {key} has shape {tuple(weight.shape)}, the adapter's delta {tuple(delta.shape)} "
            "(nor its transpose): the adapter was trained on another layout of this weight"
        )
    return (weight.float() + delta).to(weight.dtype)


def _expert_layout(config: Path) -> str:
    """The expert layout of the base's family (config.json's model_type), default fused_silu."""
    model_type = json.loads(config.read_text()).get("model_type")
    family = next((f for f in FAMILIES.values() if model_type in f.model_types), None)
    return family.expert_layout if family is not None else "fused_silu"


def _shards(base: Path) -> list[str]:
    index = base / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (base / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise KTConfigError(
        f"{base}: no model.safetensors or model.safetensors.index.json (merge reads safetensors)"
    )


def _refuse_quantized(base: Path, config: Path, adapter: KTAdapter, src) -> None:
    """A quantized base (its config, or the manifest's ``experts.base_format``) cannot take the merge."""
    fmt = detect_format(json.loads(config.read_text()), config)
    stored = adapter.info.base_format
    if fmt is None and not (stored in FORMATS and sha256_file(config) == adapter.info.base_config_sha256):
        return
    name = fmt.name if fmt is not None else stored
    raise KTConfigError(
        f"{config}: the base model is stored {name}-quantized ({FORMATS[name].description}); merge folds "
        "W + s*B@A into bf16/fp32 weights, and re-quantizing the result would round most of the LoRA update away. "
        f"Either `kt-ft dequantize {base} BASE_BF16` and `kt-ft merge {src} OUT --base BASE_BF16`, or keep the "
        f"adapter separate for serving (`kt-ft convert {src} OUT`: per-expert PEFT keys SGLang/vLLM apply "
        "on the quantized base)"
    )


def merge_adapter(
    src: str | os.PathLike, out: str | os.PathLike, base: str | os.PathLike | None = None
) -> Path:
    adapter = read_kt_adapter(src)
    base = Path(base or adapter.info.base_model)
    config = base / "config.json"
    if not config.is_file():
        raise KTConfigError(f"{config}: missing; pass --base with the local base model directory")
    _refuse_quantized(base, config, adapter, src)
    dequantized_from = json.loads(config.read_text()).get(DEQUANTIZED_FROM, {}).get("config_sha256")
    if adapter.info.base_config_sha256 not in (sha256_file(config), dequantized_from):
        raise KTConfigError(
            f"{config}: sha256 differs from base_model.config_sha256 in {adapter.path}/kt_adapter_manifest.json: "
            "the adapter was trained on another base model"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(base)
    names = set()
    for shard in shards:
        with safe_open(str(base / shard), "pt") as f:
            names.update(f.keys())
    deltas = {**_peft_deltas(adapter), **_expert_deltas(adapter, names, _expert_layout(config))}
    missing = sorted(set(deltas) - names)
    if missing:
        raise KTConfigError(f"{base}: the adapter has LoRA for weights the base model lacks: {missing[:5]}")

    for shard in tqdm(shards, desc="merging shards", unit="shard"):
        merged = {}
        with safe_open(str(base / shard), "pt") as f:
            metadata = f.metadata()
            for key in f.keys():
                t = f.get_tensor(key)
                if key in deltas:
                    t = _fold(base / shard, key, t, deltas[key]())
                merged[key] = t
        with atomic_path(out / shard) as tmp:
            save_file(merged, str(tmp), metadata=metadata or {"format": "pt"})
        del merged
    for p in base.iterdir():
        if p.is_file() and not p.name.endswith((".safetensors", ".bin", ".pt", ".pth")):
            shutil.copy2(p, out / p.name)
    return out
