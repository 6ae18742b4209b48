"""``kt-ft quantize`` / ``kt-ft dequantize``: rewrite a checkpoint's weights in another format.

``quantize`` reads a bf16 (fp16, fp32) checkpoint tensor by tensor and writes it in one of
``kt_ft.backends.quant.FORMATS``, as the models distributed that way are laid out, so kt-ft (and the
serving engines) read the result as they read those:

* ``fp8``: every projection weight (``*proj.weight``, Mixtral's expert ``w1/w2/w3``) in
  128x128-block fp8, as DeepSeek-V3's files; embeddings, the router, norms and ``lm_head`` stay
  as they are; ``quantization_config.quant_method: fp8``;
* ``int4`` / ``int8``: the routed experts only (compressed-tensors ``pack-quantized`` group 32 /
  ``int-quantized`` channel), every other projection listed in ``ignore``, as Kimi K2 Thinking's
  files;
* ``mxfp4``: gpt_oss's routed experts only, as gpt-oss's hub files: the fused
  ``{experts}.gate_up_proj`` [E, H, 2I] / ``down_proj`` [E, I, H] become
  ``{experts}.gate_up_proj_blocks`` [E, 2I, H/32, 16] / ``_scales`` [E, 2I, H/32] (each expert's
  weight transposed to [out, in] and quantized; gate/up rows keep their interleaved order) and the
  same for ``down_proj``; the biases and everything else stay as they are.

``dequantize`` is the inverse (every stored-quantized weight back to one dtype, the
``quantization_config`` dropped; gpt-oss's fused ``_blocks`` / ``_scales`` back to the fused
transposed parameter): a plain checkpoint ``merge`` and transformers read. Its
config.json records ``kt_ft_dequantized_from`` (the format and the sha256 of the quantized
checkpoint's config.json), so ``merge`` accepts it as the base of an adapter trained on the
quantized checkpoint.

Both write into a hidden temporary directory beside ``OUT`` and rename it to ``OUT`` at the end,
so ``OUT`` is either absent or complete; one input shard is in memory at a time. Tokenizer,
generation config and the other files are copied.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kt_ft.backends.quant import FORMATS, QuantFormat
from kt_ft.backends.quant_detect import config_source, detect_format
from kt_ft.base.atomic import sha256_file
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.formats.skeleton import _shards

logger = get_logger(__name__)

INDEX = "model.safetensors.index.json"
ROUTED = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# gpt_oss's fused routed experts, [E, in, out] (x @ W): what ``--format mxfp4`` quantizes
FUSED_TRANSPOSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
PROJ = re.compile(r"(proj|proj_with_mqa|\.w[123])\.weight$")
DEQUANTIZED_FROM = "kt_ft_dequantized_from"  # config.json key: the quantized checkpoint's config sha256
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def selected(fmt: QuantFormat, key: str, t: torch.Tensor) -> bool:
    """Whether ``key`` (a plain checkpoint's tensor ``t``) is stored quantized in format ``fmt``, as the
    models distributed in it are (module doc)."""
    if t.dim() != 2 or not t.is_floating_point():
        return False
    if fmt.name == "fp8":  # DeepSeek-V3: every linear projection but the router and lm_head
        return bool(PROJ.search(key)) and not key.endswith("mlp.gate.weight")
    return bool(ROUTED.search(key))  # Kimi K2: the routed experts only


def quantization_config(fmt: QuantFormat, ignored: set[str]) -> dict:
    """config.json's ``quantization_config`` for a checkpoint in ``fmt``; ``ignored``: the projections
    (key stems without ``.weight``) left unquantized, listed as compressed-tensors' ``ignore``."""
    qc = fmt.quantization_config()
    if fmt.name in ("int4", "int8"):
        qc["ignore"] = sorted(ignored | {"lm_head"})
    return qc


def _prepare_out(model_dir: Path, out_dir: Path) -> tuple[Path, dict, list[Path]]:
    if not (model_dir / "config.json").is_file():
        raise KTConfigError(f"{model_dir}: no config.json (give a model directory)")
    shards = _shards(model_dir)
    if not shards:
        raise KTConfigError(f"{model_dir}: no model.safetensors or {INDEX}")
    if out_dir.exists():
        raise KTConfigError(
            f"{out_dir}: already exists (kt-ft writes a new directory; remove it or pick another)"
        )
    if out_dir.resolve() == model_dir.resolve():
        raise KTConfigError(f"{out_dir}: the output must be another directory than the input")
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp, json.loads((model_dir / "config.json").read_text()), shards


def _copy_rest(model_dir: Path, tmp: Path) -> None:
    """Every file but the weights and config.json (tokenizer, generation config, ...)."""
    for p in model_dir.iterdir():
        if p.name == "config.json" or p.name == INDEX or p.suffix == ".safetensors" or p.name.startswith("."):
            continue
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, tmp / p.name)


def _finish(tmp: Path, out_dir: Path, config: dict, weight_map: dict[str, str], multi: bool) -> None:
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if multi:
        (tmp / INDEX).write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
        )
    for p in tmp.iterdir():  # the data is on disk before the directory's name says it is complete
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    os.rename(tmp, out_dir)


def _rewrite(model_dir: Path, out_dir: Path, convert, desc: str, config_edit) -> dict:
    """Shard by shard: ``convert(key, tensor) -> {key: tensor}``; returns counts for the summary."""
    tmp, config, shards = _prepare_out(model_dir, out_dir)
    try:
        total = 0
        for shard in shards:
            with safe_open(shard, "pt") as f:
                total += len(list(f.keys()))
        weight_map: dict[str, str] = {}
        counts: dict[str, int] = defaultdict(int)
        with tqdm(total=total, desc=desc, unit="tensor") as bar:
            for shard in shards:
                out: dict[str, torch.Tensor] = {}
                with safe_open(shard, "pt") as f:
                    keys = list(f.keys())
                    key_set = set(keys)
                    for key in keys:
                        for k, t in convert(key, f, key_set, counts).items():
                            out[k] = t.contiguous()
                        bar.update(1)
                save_file(out, tmp / shard.name, metadata={"format": "pt"})
                counts["bytes_out"] += (tmp / shard.name).stat().st_size
                counts["bytes_in"] += shard.stat().st_size
                weight_map.update({k: shard.name for k in out})
        config_edit(config)
        _copy_rest(model_dir, tmp)
        _finish(tmp, out_dir, config, weight_map, multi=(model_dir / INDEX).is_file())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(counts)


def quantize_fused_transposed(fmt: QuantFormat, t: torch.Tensor, key: str) -> dict[str, torch.Tensor]:
    """A fused experts tensor [E, in, out] (gpt_oss: used as x @ W) -> ``{key}_{stored}`` stacked over
    experts, each expert's [out, in] transpose quantized (gpt-oss's MXFP4 files)."""
    num, inp, out = t.shape
    problem = fmt.shape_problem(out, inp)
    if problem:
        raise KTConfigError(f"{key} {list(t.shape)}: {problem}")
    per_expert = [fmt.quantize(t[e].t()) for e in range(num)]
    return {f"{key}_{name}": torch.stack([p[name] for p in per_expert]) for name in per_expert[0]}


def dequantize_fused_transposed(
    fmt: QuantFormat, parts: dict[str, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of ``quantize_fused_transposed``: {stored name: [E, ...]} -> [E, in, out] in ``dtype``."""
    num = next(iter(parts.values())).shape[0]
    return torch.stack([fmt.dequantize({n: t[e] for n, t in parts.items()}, dtype).t() for e in range(num)])


def _mxfp4_family_check(model_dir: Path) -> None:
    """--format mxfp4 writes gpt-oss's layout: the fused gpt_oss experts only."""
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if model_type != "gpt_oss":
        raise KTConfigError(
            f"{config_source(model_dir)}: model_type={model_type!r}; --format mxfp4 writes gpt-oss's fused MXFP4 "
            "experts (gate_up_proj_blocks / _scales), for model_type 'gpt_oss' only; valid formats for other "
            f"models: {', '.join(n for n in FORMATS if n != 'mxfp4')}"
        )


def quantize_checkpoint(
    model_dir: str | Path, out_dir: str | Path, fmt_name: str, device: str | torch.device = "cpu"
) -> dict:
    """Write ``model_dir`` (a plain checkpoint) to ``out_dir`` in format ``fmt_name`` (int8, fp8,
    int4, mxfp4), each weight quantized on ``device`` (the same arithmetic there; the bench uses
    the GPU for its full-size models) and written from the CPU. Returns
    {quantized, kept, bytes_in, bytes_out}."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if fmt_name not in FORMATS:
        raise KTConfigError(f"--format {fmt_name!r} is unknown; valid choices: {', '.join(FORMATS)}")
    fmt = FORMATS[fmt_name]
    if (model_dir / "config.json").is_file():
        existing = detect_format(
            json.loads((model_dir / "config.json").read_text()), config_source(model_dir)
        )
        if existing is not None:
            raise KTConfigError(
                f"{config_source(model_dir)}: the checkpoint is already {existing.name}; `kt-ft dequantize` it first"
            )
        if fmt.name == "mxfp4":
            _mxfp4_family_check(model_dir)
    ignored: set[str] = set()

    def convert(key, f, keys, counts):
        t = f.get_tensor(key)
        if fmt.name == "mxfp4":
            if t.dim() == 3 and t.is_floating_point() and FUSED_TRANSPOSED.search(key):
                counts["quantized"] += t.shape[0]
                return _to_cpu(quantize_fused_transposed(fmt, t.to(device), key))
            counts["kept"] += 1
            return {key: t}
        if not selected(fmt, key, t):
            counts["kept"] += 1
            if t.dim() == 2 and PROJ.search(key):
                ignored.add(key[: -len(".weight")])
            return {key: t}
        counts["quantized"] += 1
        stem = key[: -len("weight")]
        return {stem + name: v for name, v in _to_cpu(fmt.quantize(t.to(device))).items()}

    def edit(config):
        config["quantization_config"] = quantization_config(fmt, ignored)

    counts = _rewrite(model_dir, out_dir, convert, f"quantize -> {fmt.name}", edit)
    logger.info(
        f"{out_dir}: {counts.get('quantized', 0)} weights in {fmt.name}, {counts.get('kept', 0)} tensors kept; "
        f"{counts['bytes_in'] / 2**20:.1f} MiB -> {counts['bytes_out'] / 2**20:.1f} MiB"
    )
    return counts


def _to_cpu(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in parts.items()}


def dequantize_checkpoint(model_dir: str | Path, out_dir: str | Path, dtype: str = "bf16") -> dict:
    """Write quantized ``model_dir`` to ``out_dir`` with every quantized weight dequantized to
    ``dtype`` (bf16, fp16, fp32) and no ``quantization_config``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise KTConfigError(f"--dtype {dtype!r} is unknown; valid choices: {', '.join(DTYPES)}")
    if not (model_dir / "config.json").is_file():
        raise KTConfigError(f"{model_dir}: no config.json (give a model directory)")
    fmt = detect_format(json.loads((model_dir / "config.json").read_text()), config_source(model_dir))
    if fmt is None:
        raise KTConfigError(
            f"{config_source(model_dir)}: no quantization_config; the checkpoint is not quantized"
        )
    names = [s.name for s in fmt.stored(1, 1)]
    marker = fmt.marker()

    def convert(key, f, keys, counts):
        if key.endswith("_" + marker) and FUSED_TRANSPOSED.search(key[: -len(marker) - 1]):
            stem = key[: -len(marker) - 1]  # gpt-oss's fused experts: {stem}_blocks, {stem}_scales
            parts = {n: f.get_tensor(f"{stem}_{n}") for n in names}
            counts["dequantized"] += parts[marker].shape[0]
            return {stem: dequantize_fused_transposed(fmt, parts, DTYPES[dtype])}
        fused_stem = key.rpartition("_")[0]
        if key.rpartition("_")[2] in names and f"{fused_stem}_{marker}" in keys:
            return {}  # a part of a fused quantized weight: written with its marker
        if key.endswith("." + marker):
            stem = key[: -len(marker)]
            parts = {n: f.get_tensor(stem + n) for n in names}
            counts["dequantized"] += 1
            return {stem + "weight": fmt.dequantize(parts, DTYPES[dtype])}
        stem, _, last = key.rpartition(".")
        if last in names and f"{stem}.{marker}" in keys:
            return {}  # a part of a quantized weight: written with its marker
        counts["kept"] += 1
        return {key: f.get_tensor(key)}

    source_sha = sha256_file(model_dir / "config.json")

    def edit(config):
        config.pop("quantization_config", None)
        # ``kt-ft merge`` takes this directory as the base of an adapter trained on the quantized one
        config[DEQUANTIZED_FROM] = {"format": fmt.name, "config_sha256": source_sha}
        config["torch_dtype"] = config["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[
            dtype
        ]

    counts = _rewrite(model_dir, out_dir, convert, f"dequantize {fmt.name} -> {dtype}", edit)
    logger.info(f"{out_dir}: {counts.get('dequantized', 0)} weights dequantized to {dtype}")
    return counts
