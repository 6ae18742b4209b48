"""Read a quantized checkpoint: routed experts stay quantized in RAM, the rest is dequantized.

transformers is given the config without its ``quantization_config`` and the routed experts on
``meta`` (``QuantizedExpertReader.device_map``), so it loads the other weights as a plain model
(an fp8 ``weight`` arrives cast, unscaled; a weight stored only packed is missing). Right after
``from_pretrained``, ``QuantizedExpertReader.fill``:

1. reads each routed expert's stored tensors (``formats.py``: fp8 bytes + block scales, packed
   int4 + group scales, int8 + channel scales, mxfp4 blocks + e8m0 scales) with ``os.preadv``
   straight into one tensor per stored name stacked over experts, and puts a ``QuantizedExperts``
   where the fused parameter was: RAM holds the files' bytes of the experts, no bf16 copy at any
   point (each layer's file range is dropped from the page cache after it is read, as
   ``moe/expert_reading.py`` does). gpt-oss's files store the experts fused over experts and
   transposed (``{experts}.gate_up_proj_blocks`` [E, 2I, H/32, 16] for the [E, H, 2I] parameter):
   read expert by expert the same way into a ``QuantizedExperts(transposed=True)``, its bf16
   biases beside them into their parameters (``find_plain_expert_tensors``);
2. puts every other linear layer the files store quantized (attention, dense and shared-expert
   projections of DeepSeek-V3's fp8 files) in a ``QuantizedLinear`` (``linear.py``) holding the
   stored tensors, dequantized inside each call (a weight that is not an ``nn.Linear``'s: overwritten
   with its dequantization in the training dtype).

Shapes and dtypes are checked against the format before anything is read; a mismatch names the
tensor, the file, what it is and what the format wants.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from kt_ft.backends.quant import ST_DTYPES, QuantFormat, Stored
from kt_ft.backends.quant_weights import QuantizedExperts
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.formats.expert_files import TensorLoc, _prefixes, read_index
from kt_ft.runtime.expert_reading import _bytes_of, _drop_cache, _point_at, _read_into
from kt_ft.runtime.quant_linear import QuantizedLinear
from kt_ft.runtime.shared_weights import meta_device_map

logger = get_logger(__name__)

# per-expert key suffixes stacked along the rows of each fused parameter
_LAYOUTS = {
    "per_expert": {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
    "mixtral": {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
}


@dataclass(frozen=True)
class QuantParamSource:
    """Where one fused expert parameter's stored tensors lie: ``parts[j][suffix][e]``.
    ``transposed``: the parameter is [E, cols, rows], the transpose of what is stored (gpt-oss)."""

    name: str  # e.g. model.layers.1.mlp.experts.gate_up_proj
    part_rows: tuple[int, ...]
    cols: int
    parts: tuple[dict[str, tuple[TensorLoc, ...]], ...]
    transposed: bool = False

    @property
    def nbytes(self) -> int:
        return sum(loc.nbytes for p in self.parts for locs in p.values() for loc in locs)


def _check(
    loc: TensorLoc | None, key: str, st: Stored, fmt: QuantFormat, where: str, like: TensorLoc | None = None
):
    """Why ``loc`` (tensor ``key``) is not the stored tensor ``st`` (None: it is). ``like``: the same
    tensor of expert 0, whose dtype every expert must share (they are stacked)."""
    if loc is None:
        return f"{where}: no tensor {key} (format {fmt.name} stores {[s.name for s in fmt.stored(1, 1)]})"
    got = ST_DTYPES.get(loc.dtype_name)
    if (
        tuple(loc.shape) != st.shape
        or not st.accepts(got)
        or (like is not None and like.dtype_name != loc.dtype_name)
    ):
        want = " or ".join(dict.fromkeys(str(d).removeprefix("torch.") for d in (st.dtype, *st.also)))
        return (
            f"{loc.file}: {key} is {loc.dtype_name} {list(loc.shape)}; format {fmt.name} wants {want} {list(st.shape)}"
            + (f" (as the first expert's {like.dtype_name})" if like is not None else "")
        )
    return None


def _part(index, prefix: str, part: str, rows: int, cols: int, num: int, fmt: QuantFormat, where: str):
    out: dict[str, tuple[TensorLoc, ...]] = {}
    for st in fmt.stored(rows, cols):
        locs = []
        for e in range(num):
            key = f"{prefix}.{e}.{part}.{st.name}"
            problem = _check(index.get(key), key, st, fmt, where, locs[0] if locs else None)
            if problem:
                return None, problem
            locs.append(index[key])
        out[st.name] = tuple(locs)
    return out, None


_WEIGHTS = ("gate_up_proj", "down_proj")


def _split_experts(loc: TensorLoc) -> tuple[TensorLoc, ...]:
    """A tensor stacked over experts on dim 0 -> one TensorLoc per expert (its byte range)."""
    num = loc.shape[0]
    step = loc.nbytes // num
    return tuple(
        TensorLoc(
            f"{loc.key}[{e}]", loc.file, loc.dtype, loc.shape[1:], loc.offset + e * step, step, loc.dtype_name
        )
        for e in range(num)
    )


def _fused_prefix(index, module_name: str, fmt: QuantFormat) -> str | None:
    """The key prefix under which the experts of ``module_name`` are stored fused and quantized
    (``{prefix}.gate_up_proj_{marker}``, gpt-oss's MXFP4 files), or None."""
    return next((p for p in _prefixes(module_name) if f"{p}.gate_up_proj_{fmt.marker()}" in index), None)


def _fused_sources(
    index, prefix: str, module_name: str, module: nn.Module, fmt: QuantFormat, where: str
) -> list[QuantParamSource]:
    """Sources of a module whose experts are stored fused over experts: ``{prefix}.{param}_{stored}``
    [E, ...] for ``gate_up_proj`` and ``down_proj`` (the stored weight is [out, in] per expert: a
    module that computes x @ W, ``is_transposed``, holds its transpose [E, in, out])."""
    transposed = bool(getattr(module, "is_transposed", False))
    sources = []
    for param in _WEIGHTS:
        num, a, b = module.get_parameter(param).shape
        rows, cols = (b, a) if transposed else (a, b)
        problem = fmt.shape_problem(rows, cols)
        if problem:
            raise KTConfigError(f"{where}: {prefix}.{param} [{num}, {rows}, {cols}] as stored: {problem}")
        part = {}
        for st in fmt.stored(rows, cols):
            key = f"{prefix}.{param}_{st.name}"
            stacked = Stored(st.name, (num, *st.shape), st.dtype, st.also)
            problem = _check(index.get(key), key, stacked, fmt, where)
            if problem:
                raise KTConfigError(problem)
            part[st.name] = _split_experts(index[key])
        sources.append(QuantParamSource(f"{module_name}.{param}", (rows,), cols, (part,), transposed))
    return sources


def find_plain_expert_tensors(
    model_dir: str | Path, model: nn.Module, expert_names: list[str], fmt: QuantFormat
) -> dict[str, TensorLoc]:
    """Parameter name -> stored tensor for every parameter of the routed-experts modules that is
    not a quantized weight (gpt-oss's ``gate_up_proj_bias`` [E, 2I] / ``down_proj_bias`` [E, H],
    bf16 in the files), for modules stored fused and quantized; the shape must be the
    parameter's and the dtype a float one (KTConfigError naming the tensor and file)."""
    index, reason = read_index(model_dir)
    if reason:
        raise KTConfigError(reason)
    out: dict[str, TensorLoc] = {}
    for module_name in expert_names:
        prefix = _fused_prefix(index, module_name, fmt)
        if prefix is None:
            continue
        module = model.get_submodule(module_name)
        for name, p in module.named_parameters(recurse=False):
            if name in _WEIGHTS:
                continue
            key = f"{prefix}.{name}"
            loc = index.get(key)
            if loc is None or loc.dtype is None or tuple(loc.shape) != tuple(p.shape):
                got = "missing" if loc is None else f"{loc.dtype_name} {list(loc.shape)}"
                raise KTConfigError(
                    f"{loc.file if loc else model_dir}: {key} is {got}; the model wants bf16, fp16 or fp32 {list(p.shape)}"
                )
            out[f"{module_name}.{name}"] = loc
    return out


def find_quantized_sources(
    model_dir: str | Path, model: nn.Module, expert_names: list[str], fmt: QuantFormat
) -> list[QuantParamSource]:
    """The stored tensors of every fused parameter of the routed-experts modules ``expert_names``
    of ``model`` (a meta skeleton: shapes only). Headers only; raises KTConfigError naming the
    tensor and file when one is missing or has the wrong shape or dtype.

    Two layouts: per expert, ``{prefix}.{e}.{gate_proj|up_proj|down_proj}.{stored}`` (or Mixtral's
    w1/w3/w2), as the fp8 / int4 / int8 checkpoints are; and fused over experts,
    ``{prefix}.{gate_up_proj|down_proj}_{stored}`` [E, ...], as gpt-oss's MXFP4 files are (their
    biases: ``find_plain_expert_tensors``)."""
    index, reason = read_index(model_dir)
    if reason:
        raise KTConfigError(reason)
    sources: list[QuantParamSource] = []
    for module_name in expert_names:
        module = model.get_submodule(module_name)
        fused = _fused_prefix(index, module_name, fmt)
        if fused is not None:
            sources += _fused_sources(index, fused, module_name, module, fmt, str(model_dir))
            continue
        params = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
        if set(params) != {"gate_up_proj", "down_proj"}:
            raise KTConfigError(
                f"{module_name}: quantized routed experts are read for the gate_up_proj [E, 2I, H] / down_proj "
                f"[E, H, I] layout without biases; this module has {params}"
            )
        num, two_i, hidden = params["gate_up_proj"]
        inter = two_i // 2
        if params["down_proj"] != (num, hidden, inter):
            raise KTConfigError(
                f"{module_name}: down_proj {params['down_proj']} is not [E, H, I] = {(num, hidden, inter)}"
            )
        found, problems = None, []
        for prefix in _prefixes(module_name):
            for layout in _LAYOUTS.values():
                if f"{prefix}.0.{layout['down_proj'][0]}.{fmt.marker()}" not in index:
                    continue
                srcs = []
                for param, parts in layout.items():
                    rows, cols = (inter, hidden) if param == "gate_up_proj" else (hidden, inter)
                    got = [_part(index, prefix, p, rows, cols, num, fmt, str(model_dir)) for p in parts]
                    problems += [why for _, why in got if why]
                    if any(why for _, why in got):
                        break
                    srcs.append(
                        QuantParamSource(
                            f"{module_name}.{param}",
                            tuple(rows for _ in parts),
                            cols,
                            tuple(p for p, _ in got),
                        )
                    )
                if len(srcs) == 2:
                    found = srcs
                    break
            if found:
                break
        if found is None:
            near = sorted(k for k in index if any(k.startswith(f"{p}.") for p in _prefixes(module_name)))[:4]
            raise KTConfigError(
                problems[:1]
                or f"{model_dir}: no {fmt.name} routed experts for {module_name} (per-expert "
                f"gate_proj/up_proj/down_proj.{fmt.marker()}); keys there: {near or 'none'}"
            )
        sources += found
    return sources


def _read_loc(fd: int, loc: TensorLoc, dst: torch.Tensor) -> None:
    _read_into(fd, loc.offset, _bytes_of(dst), loc.file)


def _install(model: nn.Module, name: str, value: QuantizedExperts) -> None:
    """Put ``value`` where the (meta) parameter ``name`` was: a plain attribute, not a parameter
    (frozen, never saved by kt-ft's checkpoints, never moved by ``.to``)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters.pop(attr, None)
    setattr(module, attr, value)


def fill_quantized_experts(
    model: nn.Module, sources: list[QuantParamSource], fmt: QuantFormat, dtype: torch.dtype | None = None
) -> int:
    """Read every source into RAM (quantized) and install it in ``model``. Returns bytes read.
    ``dtype``: the compute dtype of the experts (default: the meta parameter's, the load dtype)."""
    by_layer: dict[str, list[QuantParamSource]] = defaultdict(list)
    for src in sources:
        by_layer[src.name.rpartition(".")[0]].append(src)
    fds: dict[Path, int] = {}
    total = 0
    try:
        bar = tqdm(by_layer.items(), desc=f"routed experts ({fmt.name}) -> CPU RAM", unit="layer")
        for _, layer_sources in bar:
            ranges: dict[Path, list[tuple[int, int]]] = defaultdict(list)
            for src in layer_sources:
                dt = dtype or model.get_parameter(src.name).dtype
                parts = []
                for part in src.parts:
                    stacked = {}
                    for suffix, locs in part.items():
                        first = locs[0]
                        t = torch.empty((len(locs), *first.shape), dtype=ST_DTYPES[first.dtype_name])
                        for e, loc in enumerate(locs):
                            fd = fds.get(loc.file)
                            if fd is None:
                                fd = fds[loc.file] = os.open(loc.file, os.O_RDONLY)
                            _read_loc(fd, loc, t[e])
                            ranges[loc.file].append((loc.offset, loc.offset + loc.nbytes))
                        stacked[suffix] = t
                    parts.append(stacked)
                qe = QuantizedExperts(fmt, parts, list(src.part_rows), src.cols, dt, src.transposed)
                _install(model, src.name, qe)
                total += qe.nbytes()
            for file, rs in ranges.items():
                _drop_cache(fds[file], rs)
            bar.set_postfix_str(fmt_bytes(total))
    finally:
        for fd in fds.values():
            os.close(fd)
    logger.info(
        f"routed experts: {fmt_bytes(total)} of {fmt.name} ({fmt.description}) in {len(by_layer)} layers read "
        "from the safetensors files into CPU RAM, kept quantized (dequantized when computed, a bounded chunk of "
        "experts at a time)"
    )
    return total


def fill_plain_expert_tensors(model: nn.Module, plain: dict[str, TensorLoc]) -> int:
    """Read each of ``plain`` (``find_plain_expert_tensors``) into its meta parameter of ``model``,
    in that parameter's dtype. Returns bytes held."""
    total = 0
    for name, loc in plain.items():
        t = read_stored(loc).to(model.get_parameter(name).dtype)
        _point_at(model, name, t)
        total += t.numel() * t.element_size()
    return total


def read_stored(loc: TensorLoc) -> torch.Tensor:
    """One tensor of a safetensors file, read into a new CPU tensor."""
    t = torch.empty(loc.shape, dtype=ST_DTYPES[loc.dtype_name])
    fd = os.open(loc.file, os.O_RDONLY)
    try:
        _read_loc(fd, loc, t)
    finally:
        os.close(fd)
    return t


def dequantize_other_weights(model: nn.Module, model_dir: str | Path, fmt: QuantFormat) -> int:
    """Every parameter ``X.weight`` of ``model`` the files store quantized (``X.<marker>`` present):
    its ``nn.Linear`` replaced by a ``QuantizedLinear`` of the stored tensors (on the weight's
    device, computing in its dtype); a weight of another module is overwritten with its
    dequantization in the parameter's dtype. Returns the count of either."""
    index, reason = read_index(model_dir)
    if reason:
        raise KTConfigError(reason)
    done = kept = kept_bytes = 0
    for name, p in list(model.named_parameters()):
        if not name.endswith(".weight") or p.device.type == "meta":
            continue
        stem = name[: -len("weight")]
        for prefix in _prefixes(stem.rstrip(".")):
            if f"{prefix}.{fmt.marker()}" not in index:
                continue
            out, inp = p.shape if p.dim() == 2 else (None, None)
            if out is None:
                raise KTConfigError(
                    f"{model_dir}: {prefix}.{fmt.marker()} is stored {fmt.name} but {name} is {list(p.shape)}, not a matrix"
                )
            parts = {}
            for st in fmt.stored(out, inp):
                key = f"{prefix}.{st.name}"
                problem = _check(index.get(key), key, st, fmt, str(model_dir))
                if problem:
                    raise KTConfigError(problem)
                parts[st.name] = read_stored(index[key])
            owner_name = stem.rstrip(".")
            owner = model.get_submodule(owner_name)
            if type(owner) is nn.Linear:
                q = QuantizedLinear(
                    fmt,
                    {k: v.to(p.device) for k, v in parts.items()},
                    out_features=out,
                    in_features=inp,
                    bias=owner.bias,
                    dtype=p.dtype,
                )
                parent, _, child = owner_name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, q)
                kept += 1
                kept_bytes += q.stored_nbytes()
            else:
                with torch.no_grad():
                    p.data.copy_(fmt.dequantize(parts, p.dtype))
            done += 1
            break
    if done - kept:
        logger.info(
            f"{done - kept} weights stored {fmt.name} outside the routed experts dequantized to the training dtype"
        )
    if kept:
        logger.info(
            f"{kept} linear layers stored {fmt.name} outside the routed experts kept as stored "
            f"({fmt_bytes(kept_bytes)}), dequantized inside each call"
        )
    return done


def stored_linear_weights(model: nn.Module, model_dir: str | Path, fmt: QuantFormat) -> dict[str, int]:
    """Parameter name -> stored bytes of the linear weights outside the routed experts that a load
    keeps quantized (``dequantize_other_weights``): for ``kt-ft rules plan`` from the config and the
    files' headers (``model`` may be on ``meta``). Empty without safetensors files."""
    index, reason = read_index(model_dir)
    if reason:
        return {}
    out: dict[str, int] = {}
    for name, m in model.named_modules():
        if type(m) is not nn.Linear:
            continue
        if any(f"{prefix}.{fmt.marker()}" in index for prefix in _prefixes(name)):
            out[f"{name}.weight"] = fmt.nbytes(m.out_features, m.in_features)
    return out


def release_file_mappings(model: nn.Module) -> None:
    """Give every CPU parameter and buffer of ``model`` its own memory, so that transformers' maps
    of the safetensors files are closed. Why: transformers reads every tensor of the files, the
    routed experts' too (it materializes each one before putting it on ``meta``: an fp8 tensor is
    read to be cast), and tensors it keeps as views of a map (norm weights stored in the load
    dtype) keep the whole map, with those expert pages in RSS, alive; measured: +69 MiB of file
    pages beside 72 MiB of fp8 experts (tests/test_quant.py). The copies are the non-expert
    weights on the CPU, one tensor at a time."""
    with torch.no_grad():
        for p in model.parameters():
            if p.device.type == "cpu":
                p.data = p.data.clone()
        for module in model.modules():
            for name, b in list(module._buffers.items()):
                if b is not None and b.device.type == "cpu":
                    module._buffers[name] = b.clone()


@dataclass
class QuantizedExpertReader:
    """The routed experts of a quantized checkpoint, read by kt-ft (transformers reads the rest)."""

    model_dir: Path
    expert_names: list[str]
    sources: list[QuantParamSource]
    fmt: QuantFormat
    plain: dict[str, TensorLoc] = field(default_factory=dict)  # the experts' biases (gpt-oss)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sources)

    def device_map(self, device_map: dict) -> dict:
        """``device_map`` with the routed experts on ``meta`` (transformers reads none of them)."""
        return meta_device_map(device_map, self.expert_names)

    def fill(self, model: nn.Module, allocate=None) -> int:
        """Experts read quantized into ``model``, the other quantized weights dequantized."""
        if allocate is not None:
            raise KTConfigError(
                f"{self.model_dir}: {self.fmt.name} routed experts shared by several ranks of a machine are not "
                "supported yet; set KT_FT_SHARED_DIR=off (each rank reads its own quantized copy)"
            )
        release_file_mappings(model)
        total = fill_quantized_experts(model, self.sources, self.fmt)
        total += fill_plain_expert_tensors(model, self.plain)
        dequantize_other_weights(model, self.model_dir, self.fmt)
        return total
