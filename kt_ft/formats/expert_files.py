"""Where each routed expert's bytes lie in a model's safetensors files (headers only).

kt-ft fills the fused routed-expert tensors itself (``expert_reading``), reading straight from
the files; this module says, for every fused parameter of every routed-experts module, which
byte range of which file holds each expert's slice. Only the safetensors headers are read.

Layouts found in checkpoints of the supported families (transformers 5.6's
``conversion_mapping`` fuses the first two while loading; ``save_pretrained`` writes them back):

* per expert, ``{prefix}.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj``
  [H, I] (qwen2/3_moe, deepseek_v2/v3, glm4_moe, olmoe) -> ``gate_up_proj[e, :I]`` gate,
  ``gate_up_proj[e, I:]`` up, ``down_proj[e]``;
* per expert, Mixtral's ``w1`` (gate), ``w3`` (up), ``w2`` (down) under ``block_sparse_moe``;
* already fused: ``{prefix}.{param}`` with the parameter's own shape (qwen3_5_moe, gpt_oss in
  bf16 with its biases), copied as is;
* fused and transposed, ``{prefix}.gate_up_proj`` [E, H, 2I] / ``down_proj`` [E, I, H]: the
  Qwen3-VL-MoE hub files (``TRANSPOSED_FUSED``), which transformers transposes while loading
  (``Transpose(1, 2, check_dims=True)``: only where the shape is not already the parameter's, as
  here); each expert goes through a one-expert buffer and is transposed into its slice.

``prefix`` is the module's dotted name, or Mixtral's ``block_sparse_moe`` in place of ``mlp``,
or with ``model.language_model.`` in place of ``model.`` (a vision-language composite's text
weights loaded as a text model). Quantized experts (gpt_oss's MXFP4 ``_blocks``/``_scales``, FP8
with scales, INT4 / INT8) are read by ``kt_ft.runtime.quant_loading`` when config.json says so; anything
else here (other dtypes, another layout) is not found: ``find_expert_sources`` returns the reason
and kt-ft lets transformers load the experts.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kt_ft.formats.skeleton import _shards

# model types whose checkpoints store fused experts transposed ([E, in, out]), as transformers 5.6's
# conversion_mapping says for them
TRANSPOSED_FUSED = frozenset({"qwen3_vl_moe"})

# dtypes read by plain byte copy (or converted with copy_ when the load dtype differs)
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class TensorLoc:
    """One tensor of a safetensors file."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    dtype_name: str = ""  # the header's own name (F8_E4M3, I32, ...): dtype is None for those


@dataclass(frozen=True)
class Piece:
    """Copy ``nbytes`` at ``offset`` of ``file`` (``shape``, ``dtype``) into ``param[expert, rows]``."""

    file: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    expert: int
    rows: tuple[int, int] | None  # [start, stop) of dim 1 of the target; None: the whole slice
    transposed: bool = False  # ``shape`` is the target slice's transpose: copy it transposed


@dataclass(frozen=True)
class ParamSource:
    """Every piece of one fused parameter (``name``: dotted, e.g. ``model.layers.0.mlp.experts.down_proj``)."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    layout: str  # "per_expert" | "mixtral" | "fused" | "fused_transposed": what was found, for the log

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def read_index(model_dir: str | Path) -> tuple[dict[str, TensorLoc], str | None]:
    """Every tensor of the checkpoint's safetensors files (headers only), or the reason there are none."""
    model_dir = Path(model_dir)
    shards = _shards(model_dir)
    if not shards:
        return {}, f"{model_dir}: no model.safetensors or model.safetensors.index.json"
    index: dict[str, TensorLoc] = {}
    for shard in shards:
        try:
            with shard.open("rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            return {}, f"{shard}: unreadable safetensors header ({e})"
        base = 8 + n  # data offsets count from the end of the header
        for key, t in header.items():
            if key == "__metadata__":
                continue
            start, end = t["data_offsets"]
            dtype = _DTYPES.get(t["dtype"])
            index[key] = TensorLoc(
                key,
                shard,
                dtype,
                tuple(t["shape"]),
                base + start,
                end - start,
                t["dtype"],  # type: ignore[arg-type]
            )
    return index, None


def _prefixes(module_name: str) -> list[str]:
    out = [module_name]
    if ".mlp.experts" in module_name:
        out.append(module_name.replace(".mlp.experts", ".block_sparse_moe.experts"))
    out += [p.replace("model.", "model.language_model.", 1) for p in list(out) if p.startswith("model.")]
    return out


def _usable(loc: TensorLoc | None, shape: tuple[int, ...]) -> bool:
    return loc is not None and loc.dtype is not None and loc.shape == shape


def _fused(index, prefix, name, shape, transposed_ok: bool = False) -> ParamSource | None:
    loc = index.get(f"{prefix}.{name.rpartition('.')[2]}")
    transposed = (
        transposed_ok
        and len(shape) == 3
        and not _usable(loc, shape)
        and _usable(loc, (shape[0], shape[2], shape[1]))
    )
    if not (_usable(loc, shape) or transposed):
        return None
    step = loc.nbytes // shape[0]
    pieces = tuple(
        Piece(loc.file, loc.offset + e * step, step, loc.dtype, loc.shape[1:], e, None, transposed)
        for e in range(shape[0])
    )
    return ParamSource(name, shape, pieces, "fused_transposed" if transposed else "fused")


def _per_expert(index, prefix, name, shape, parts: list[str], layout: str) -> ParamSource | None:
    """``parts``: the per-expert key suffixes stacked along dim 1 of the target (gate, up) or (down,)."""
    num, rows = shape[0], shape[1] // len(parts)
    pieces = []
    for e in range(num):
        for j, part in enumerate(parts):
            loc = index.get(f"{prefix}.{e}.{part}.weight")
            if not _usable(loc, (rows, *shape[2:])):
                return None
            pieces.append(
                Piece(loc.file, loc.offset, loc.nbytes, loc.dtype, loc.shape, e, (j * rows, (j + 1) * rows))
            )
    return ParamSource(name, shape, tuple(pieces), layout)


_PER_EXPERT = {
    "per_expert": {"gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]},
    "mixtral": {"gate_up_proj": ["w1", "w3"], "down_proj": ["w2"]},
}


def _module_sources(
    index, module_name: str, module: nn.Module, transposed_ok: bool = False
) -> list[ParamSource] | None:
    params = [(f"{module_name}.{n}", tuple(p.shape)) for n, p in module.named_parameters(recurse=False)]
    for prefix in _prefixes(module_name):
        fused = [_fused(index, prefix, n, s, transposed_ok) for n, s in params]
        if all(fused):
            return fused  # type: ignore[return-value]
        for layout, parts in _PER_EXPERT.items():
            if {n.rpartition(".")[2] for n, _ in params} != set(parts):
                continue
            found = [_per_expert(index, prefix, n, s, parts[n.rpartition(".")[2]], layout) for n, s in params]
            if all(found):
                return found  # type: ignore[return-value]
    return None


def find_expert_sources(
    model_dir: str | Path, model: nn.Module, expert_names: list[str]
) -> tuple[list[ParamSource], str | None]:
    """The sources of every parameter of the routed-experts modules ``expert_names`` of ``model``
    (a meta skeleton is enough: shapes only), or ([], the reason kt-ft cannot read them itself)."""
    index, reason = read_index(model_dir)
    if reason:
        return [], reason
    sources: list[ParamSource] = []
    transposed_ok = getattr(getattr(model, "config", None), "model_type", None) in TRANSPOSED_FUSED
    for module_name in expert_names:
        module = model.get_submodule(module_name)
        found = _module_sources(index, module_name, module, transposed_ok)
        if found is None:
            shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
            near = sorted(k for k in index if any(k.startswith(f"{p}.") for p in _prefixes(module_name)))[:4]
            return [], (
                f"{model_dir}: the checkpoint's keys for {module_name} ({near or 'none'}...) are not a layout kt-ft "
                f"reads itself (per-expert gate_proj/up_proj/down_proj or w1/w3/w2, or fused {shapes}, in bf16/fp16/fp32)"
            )
        sources += found
    return sources, None
