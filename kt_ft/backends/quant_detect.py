"""Which quantized format a checkpoint's config says its weights are in; refuse the others.

Read from ``config.json``'s ``quantization_config`` before any weight is read, so a checkpoint
kt-ft cannot read stops at once with the file, the key, the value and what is supported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kt_ft.backends.quant import FORMATS, FP8_BLOCK, INT4_GROUP, MXFP4_GROUP, QuantFormat
from kt_ft.base.errors import KTConfigError

SUPPORTED = (
    f"fp8 (fmt e4m3, weight_block_size [{FP8_BLOCK}, {FP8_BLOCK}]: DeepSeek-V3/R1), "
    f"compressed-tensors pack-quantized (int4, symmetric, group {INT4_GROUP}: Kimi K2 Thinking), "
    "compressed-tensors int-quantized (int8, symmetric, channel: kt-ft quantize --format int8) and "
    f"mxfp4 (fp4 e2m1, e8m0 scale per {MXFP4_GROUP}: gpt-oss's routed experts)"
)
_FIX = "convert the checkpoint to bf16 (or to one of those with `kt-ft quantize`) first"


def _get(qc: Any, key: str, default: Any = None) -> Any:
    return qc.get(key, default) if isinstance(qc, dict) else getattr(qc, key, default)


def quantization_config(config: Any) -> dict | None:
    """The config's ``quantization_config`` as a dict (text config of a composite too), or None."""
    for c in (config, getattr(config, "text_config", None)):
        qc = (
            None
            if c is None
            else (
                c.get("quantization_config")
                if isinstance(c, dict)
                else getattr(c, "quantization_config", None)
            )
        )
        if qc is not None:
            return (
                qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc)))
            )
    return None


def _bad(where: str, key: str, value: Any, expected: str | None = None) -> KTConfigError:
    want = f" (expected {expected})" if expected else ""
    return KTConfigError(
        f"{where}: {key}={value!r} is not a quantization kt-ft reads{want}; supported: {SUPPORTED}; {_FIX}"
    )


def _compressed_tensors(qc: dict, where: str) -> QuantFormat:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if fmt not in ("pack-quantized", "int-quantized"):
        raise _bad(where, "quantization_config.format", fmt, "pack-quantized or int-quantized")
    if len(groups) != 1:
        raise _bad(where, "quantization_config.config_groups", sorted(groups), "exactly one group")
    ((name, group),) = groups.items()
    w = group.get("weights") or {}
    key = f"quantization_config.config_groups.{name}.weights"
    if group.get("input_activations") or group.get("output_activations"):
        raise _bad(
            where,
            f"quantization_config.config_groups.{name}.input_activations",
            group.get("input_activations"),
            "weight-only quantization (null activations)",
        )
    want = (
        {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP}
        if fmt == "pack-quantized"
        else {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    )
    for k, v in want.items():
        if w.get(k) != v:
            raise _bad(where, f"{key}.{k}", w.get(k), f"{v!r} with format {fmt}")
    return FORMATS["int4" if fmt == "pack-quantized" else "int8"]


def _fp8(qc: dict, where: str) -> QuantFormat:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _bad(where, "quantization_config.fmt", qc.get("fmt"), "e4m3")
    block = qc.get("weight_block_size")
    if block is None or list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise _bad(
            where,
            "quantization_config.weight_block_size",
            block,
            f"[{FP8_BLOCK}, {FP8_BLOCK}] (per-block scales)",
        )
    return FORMATS["fp8"]


def detect_format(config: Any, source: str | Path = "config.json") -> QuantFormat | None:
    """The format of a quantized checkpoint (None: not quantized). ``source``: where ``config``
    came from, for the error. Raises KTConfigError for a method or scheme kt-ft does not read."""
    qc = quantization_config(config)
    if qc is None:
        return None
    where = str(source)
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "mxfp4":  # one scheme; modules_to_not_convert lists what the files keep in bf16
        return FORMATS["mxfp4"]
    raise _bad(where, "quantization_config.quant_method", method)


def config_source(model_dir: str | Path | None) -> str:
    """``<model_dir>/config.json`` for errors (or ``config.json`` when there is no directory)."""
    return str(Path(model_dir) / "config.json") if model_dir else "config.json"


def take_quantization_config(config: Any, source: str | Path = "config.json") -> QuantFormat | None:
    """``detect_format``, then remove ``quantization_config`` from ``config`` (and its text config)
    so transformers loads the checkpoint as a plain model: kt-ft reads the quantized tensors itself
    (``loading.py``). Raises before anything is removed when the method is not supported."""
    fmt = detect_format(config, source)
    if fmt is not None:
        for c in (config, getattr(config, "text_config", None)):
            if c is not None and getattr(c, "quantization_config", None) is not None:
                delattr(c, "quantization_config")
    return fmt
