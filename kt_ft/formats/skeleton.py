"""A model's module tree without its weights: built on the meta device from config.json.

``kt-ft rules check --model`` and ``kt-ft rules plan`` match rules against this skeleton, so
they take seconds and no memory even for a 235B model. The weight dtype comes from the
safetensors headers when the checkpoint is there (only the first bytes of each shard are read),
else from the config.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import torch

from kt_ft.base.errors import KTConfigError

# safetensors dtype names -> torch dtypes (the ones MoE checkpoints use)
_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [model_dir / n for n in names if (model_dir / n).is_file()]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else []


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def checkpoint_dtype(model_dir: str | Path, config) -> tuple[torch.dtype, str]:
    """The dtype most checkpoint bytes have (safetensors headers), else the config's; and where from."""
    model_dir = Path(model_dir)
    tally: Counter = Counter()
    for shard in _shards(model_dir):
        try:
            header = _header(shard)
        except (OSError, ValueError, struct.error):
            continue
        for key, t in header.items():
            if key != "__metadata__" and t.get("dtype") in _ST_DTYPES:
                start, end = t["data_offsets"]
                tally[t["dtype"]] += end - start
    if tally:
        return _ST_DTYPES[tally.most_common(1)[0][0]], "safetensors headers"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype):
        return dtype, "config.json"
    return torch.float32, "default (no dtype in config.json)"


def load_config(model_dir: str | Path):
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise KTConfigError(f"{model_dir}: no config.json (give a model directory)")
    return AutoConfig.from_pretrained(model_dir)


def meta_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The model class LLaMA-Factory would load (causal LM, else image-text-to-text), on meta."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # the same choice as LLaMA-Factory's loader: vision-language composites (the Qwen3.5-MoE
    # checkpoints) are image-text-to-text models, the rest causal LMs
    image_text = type(config) in AutoModelForImageTextToText._model_mapping.keys()
    cls = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    with torch.device("meta"):
        return cls.from_config(config, dtype=dtype)
