"""Random checkpoints of the flagship models at their real width, written shard by shard.

``write_random_checkpoint(preset, layers, out)`` writes a ``preset`` of ``REAL_WIDTH`` with
``layers`` decoder layers (DeepSeek-V3 and Kimi K2: the first dense, the rest MoE; Qwen3: all MoE, as
the real one) as its weights are distributed: DeepSeek-V3
in 128x128-block FP8 (every projection but the router and ``lm_head``), Kimi K2 with INT4 routed
experts (compressed-tensors pack-quantized, group 32), Qwen3-235B-A22B in bf16. Tensor names are the
hub files' (``mlp.experts.{j}.gate_proj.weight``, ...), so kt-ft, transformers and ``kt-ft quantize``
read the directory as they read the real one.

Never the whole model in memory: the tensor names and shapes come from a meta-device model of the
config, values are drawn (normal, std 0.02, bf16; norms 1, biases 0) and quantized one tensor (one
expert) at a time, and a shard is flushed to disk every ``shard_bytes``. The directory is written
under a hidden temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kt_ft.backends.quant import FORMATS
from kt_ft.integrations.export.quantize import INDEX, quantization_config, selected

_DEEPSEEK_V3 = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    vocab_size=129280,
    n_group=8,
    topk_group=4,
    topk_method="noaux_tc",
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

# preset -> (model_type, the real model's config, the format its files are distributed in (None: bf16))
REAL_WIDTH: dict[str, tuple[str, dict, str | None]] = {
    "deepseek-v3": ("deepseek_v3", _DEEPSEEK_V3, "fp8"),
    "kimi-k2": (
        "deepseek_v3",
        {
            **_DEEPSEEK_V3,
            "n_routed_experts": 384,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "first_k_dense_replace": 1,
            "vocab_size": 163840,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.827,
        },
        "int4",
    ),
    "qwen3-235b-a22b": (
        "qwen3_moe",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
        ),
        None,
    ),
}
FUSED = re.compile(r"^(?P<stem>.*\.experts)\.(?P<name>gate_up_proj|down_proj)$")
STD = 0.02


def config_for(preset: str, layers: int, overrides: dict | None = None):
    """The transformers config of ``preset`` at ``layers`` decoder layers (``overrides``: other values,
    e.g. a reduced width for tests)."""
    from transformers import AutoConfig

    model_type, cfg, _ = REAL_WIDTH[preset]
    cfg = {**cfg, "num_hidden_layers": layers, **(overrides or {})}
    if "first_k_dense_replace" in cfg:  # DeepSeek-V3 / Kimi K2: layer 0 dense (the real V3 has 3)
        cfg["first_k_dense_replace"] = min(1, layers)
    return AutoConfig.for_model(model_type, **cfg)


def _shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of ``config``'s model, built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return [(k, tuple(t.shape)) for k, t in model.state_dict().items()]


def _values(key: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        return (torch.ones if "norm" in key else torch.zeros)(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen) * STD).to(torch.bfloat16)


def _tensors(shapes, fmt, gen: torch.Generator, ignored: set[str]) -> Iterator[dict[str, torch.Tensor]]:
    """For each stored weight, its tensors as the files hold them: fused experts split per expert
    (``{stem}.{j}.gate_proj.weight``, ...), each quantized where ``fmt`` quantizes it."""

    def stored(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if fmt is None or not selected(fmt, key, t):
            if fmt is not None and t.dim() == 2 and key.endswith("proj.weight"):
                ignored.add(key[: -len(".weight")])
            return {key: t}
        stem = key[: -len("weight")]
        return {stem + n: v.contiguous() for n, v in fmt.quantize(t).items()}

    for key, shape in shapes:
        m = FUSED.match(key)
        if m is None:
            yield stored(key, _values(key, shape, gen))
            continue
        num, rows, cols = shape
        for j in range(num):
            base = f"{m['stem']}.{j}"
            if m["name"] == "gate_up_proj":  # [E, 2I, H]: rows :I gate, I: up
                half = rows // 2
                yield {
                    **stored(f"{base}.gate_proj.weight", _values(key, (half, cols), gen)),
                    **stored(f"{base}.up_proj.weight", _values(key, (half, cols), gen)),
                }
            else:
                yield stored(f"{base}.down_proj.weight", _values(key, (rows, cols), gen))


def write_random_checkpoint(
    preset: str,
    layers: int,
    out: str | Path,
    *,
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    overrides: dict | None = None,
) -> tuple[Path, int]:
    """Write ``preset`` at ``layers`` decoder layers (module doc) to ``out`` (must not exist).
    Returns (out, bytes written)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: already exists (give a new directory)")
    _, _, fmt_name = REAL_WIDTH[preset]
    fmt = FORMATS[fmt_name] if fmt_name else None
    config = config_for(preset, layers, overrides)
    shapes = _shapes(config)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    ignored: set[str] = set()
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    held = written = 0
    names: list[str] = []

    def flush() -> None:
        nonlocal shard, held, written
        if not shard:
            return
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shard, tmp / name, metadata={"format": "pt"})
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        written += (tmp / name).stat().st_size
        shard, held = {}, 0

    total = sum(s[0] if FUSED.match(k) else 1 for k, s in shapes)
    try:
        with tqdm(total=total, desc=f"write {preset} x{layers}", unit="tensor") as bar:
            for tensors in _tensors(shapes, fmt, gen, ignored):
                shard.update(tensors)
                held += sum(t.numel() * t.element_size() for t in tensors.values())
                bar.update(1)
                if held >= shard_bytes:
                    flush()
            flush()
        cfg = config.to_dict()
        cfg["torch_dtype"] = "bfloat16"
        if fmt is not None:
            cfg["quantization_config"] = quantization_config(fmt, ignored)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / INDEX).write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        )
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, written
