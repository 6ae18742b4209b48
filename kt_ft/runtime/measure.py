"""The machine's rates for the cost model, measured in a few seconds and cached per machine.

* CPU: the selected CPU backend's forward + backward on a small batch of real-shaped experts
  (the layer's H and I, at most 8 experts -- kt-kernel: the whole layer --, as many rows per
  expert as the planned micro-batch gives: T·k/E, at most 512), counted with
  ``LayerShape.pair_flops``.
* link: a pinned host -> GPU copy of 256 MiB.
* GPU: a dense bf16 matmul (8192²), and one layer of resident experts computed as a run computes
  them (``measure_gpu_expert_flops``: its overheads, the LoRA kept where a run keeps it, are in
  the rate).

Cached in ``~/.cache/kt-ft/rates.json`` (``KT_FT_CACHE_DIR`` moves it), keyed by the CPU model,
physical cores / logical CPUs, the GPU's name and the torch version; the CPU figure also by
backend, threads and the layer shape, the expert-GPU figure by shape. ``remeasure`` refreshes.
Without CUDA the link and GPU figures are absent (the planner then keeps every expert on the
CPU). Figures given as overrides (``parse_overrides``) are never measured.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kt_ft.backends.base import ExpertWeights
from kt_ft.backends.registry import select_backend
from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.base.settings import get
from kt_ft.formats.lora_layout import expert_lora_shapes
from kt_ft.plan.cost import LayerShape, Rates
from kt_ft.plan.homes import lora_home
from kt_ft.plan.recipe import physical_cpu_cores
from kt_ft.runtime.device_experts import DeviceExperts
from kt_ft.runtime.op_timing import Preset, random_layer, time_op
from kt_ft.runtime.resident import ResidentExperts

logger = get_logger(__name__)

CACHE_ENV = "KT_FT_CACHE_DIR"
OVERRIDE_KEYS = {
    "cpu_token_us": "microseconds of CPU op per token of one MoE layer, forward + backward",
    "cpu_pair_us": "microseconds of CPU op per (token, slot) pair, forward + backward",
    "cpu_tflops": "the CPU op's effective TFLOP/s (12·H·I + 18·r·(H + I) FLOPs a pair)",
    "link_gbps": "pinned host -> GPU copy, GB/s (1e9 bytes)",
    "gpu_tflops": "dense bf16 matmul TFLOP/s",
    "gpu_expert_tflops": "the GPU's TFLOP/s on expert-shaped products (default: gpu_tflops)",
}


def parse_overrides(text: str | None) -> dict[str, float]:
    """``"cpu_token_us=90,link_gbps=55"`` -> {key: value}; KTConfigError naming the valid keys."""
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        valid = "; ".join(f"{k} ({v})" for k, v in OVERRIDE_KEYS.items())
        if not sep or key not in OVERRIDE_KEYS:
            raise KTConfigError(f"--rates {text!r}: {item.strip()!r} is not KEY=NUMBER; valid keys: {valid}")
        try:
            v = float(value)
        except ValueError:
            v = float("nan")
        if not math.isfinite(v) or v <= 0:
            raise KTConfigError(f"--rates {text!r}: {key}={value.strip()!r}: expected a positive number")
        out[key] = v
    if sum(k.startswith("cpu_") for k in out) > 1:
        raise KTConfigError(f"--rates {text!r}: give one of cpu_token_us, cpu_pair_us, cpu_tflops")
    return out


def apply_overrides(rates: Rates, overrides: dict[str, float], shape: LayerShape, rank: int) -> Rates:
    """``rates`` with the figures ``overrides`` gives replaced (the CPU ones converted with ``shape``)."""
    fig = {
        "cpu_flops": rates.cpu_flops,
        "link_bytes_s": rates.link_bytes_s,
        "gpu_flops": rates.gpu_flops,
        "gpu_expert_flops": rates.gpu_expert_flops,
    }
    src = dict(rates.source)
    pair = shape.pair_flops(rank)
    conv = {
        "cpu_token_us": ("cpu_flops", lambda v: shape.top_k * pair / (v * 1e-6)),
        "cpu_pair_us": ("cpu_flops", lambda v: pair / (v * 1e-6)),
        "cpu_tflops": ("cpu_flops", lambda v: v * 1e12),
        "link_gbps": ("link_bytes_s", lambda v: v * 1e9),
        "gpu_tflops": ("gpu_flops", lambda v: v * 1e12),
        "gpu_expert_tflops": ("gpu_expert_flops", lambda v: v * 1e12),
    }
    for key, value in overrides.items():
        name, f = conv[key]
        fig[name] = f(value)
        src[name] = f"given ({key}={value:g})"
    return Rates(**fig, source=src)


def cache_path() -> Path:
    root = get(CACHE_ENV) or str(Path.home() / ".cache" / "kt-ft")
    return Path(root) / "rates.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(cuda: bool) -> str:
    """CPU model, physical cores / logical CPUs, GPU name (or "no GPU"), torch version."""

    gpu = torch.cuda.get_device_name(0) if cuda else "no GPU"
    return f"{_cpu_model()} | {physical_cpu_cores()}c/{os.cpu_count()}t | {gpu} | torch {torch.__version__}"


def rows_per_expert(shape: LayerShape, tokens: int) -> int:
    """Rows an expert's products get in a micro-batch of ``tokens`` (T·k/E), in 1..512."""
    return max(1, min(512, round(tokens * shape.top_k / shape.num_experts)))


def _best(fn: Callable[[], None], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()  # warm-up
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu_flops(shape: LayerShape, backend: str, threads: int, tokens: int, rank: int = 8) -> float:
    """The CPU op's effective FLOP/s (``pair_flops``) on a small real-shaped batch (see module doc)."""

    name = select_backend(backend, torch.bfloat16)[0].name
    # kt-kernel: the whole layer. Its per-call costs are the layer's, not per expert: measured on
    # 8 experts it predicted a 4-layer Qwen3-30B-A3B step on the GPU machine at 11.3 s, which ran
    # in 1.05 s. The torch backends' per-pair cost holds at 8 experts (their products are per expert)
    experts = shape.num_experts if name == "kt-kernel" else min(shape.num_experts, 8)
    k = shape.top_k if name == "kt-kernel" else min(shape.top_k, max(1, experts // 2))
    t = math.ceil(rows_per_expert(shape, tokens) * experts / k)
    p = Preset("measure", shape.hidden, shape.inter, experts, k, 1)
    gen = torch.Generator().manual_seed(0)
    sec = time_op(p, random_layer(p, rank, gen), name, t, threads, 2, gen)
    return t * k * LayerShape(experts, shape.hidden, shape.inter, k).pair_flops(rank) / sec


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def measure_link_bytes_s(nbytes: int = 256 * 2**20, device: str = "cuda") -> float:
    """Host -> ``device`` copy rate from pinned memory (``cpu``: a plain memory copy, for the bench's
    CPU-only smoke run where the "GPU" is the CPU)."""
    cuda = device.startswith("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8)
    src = src.pin_memory() if cuda else src
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _best(lambda: dst.copy_(src, non_blocking=cuda), 5, _sync(device))


def measure_gpu_flops(n: int = 8192, device: str = "cuda") -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def run():
        for _ in range(5):
            a @ b

    return 5 * 2 * n**3 / _best(run, 3, _sync(device))


def measure_gpu_expert_flops(shape: LayerShape, tokens: int, device: str = "cuda", rank: int = 8) -> float:
    """The device experts' rate as a run gets it: one layer of resident experts through
    ``moe/device_experts.py`` (routing split, the LoRA where a run keeps it -- on the device for an
    all-device layer of one process, else the rows' copy there and their gradients' copy back --,
    grouped products, autograd), forward + backward, counted with ``pair_flops`` (the
    cost model adds the recompute's forward at this rate). Every expert of the layer when they fit
    in 4 GiB, else fewer at the same rows per expert (2 GiB where the resident copy is the wide
    layout's, ``kernels/grouped_wide.py``: the weights made here and that copy exist at once)."""

    h, i, k = shape.hidden, shape.inter, shape.top_k
    budget = 4 * 2**30 // (2 if shape.resident_bytes(rank) > shape.expert_bytes else 1)
    e = max(k, min(shape.num_experts, budget // max(1, shape.expert_bytes)))
    m = rows_per_expert(shape, tokens)
    t = max(1, math.ceil(m * e / k))
    dev, bf = torch.device(device), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*size, scale=1.0, dtype=bf, on=dev):
        return (torch.randn(*size, generator=gen, device=dev, dtype=dtype) * scale).to(on)

    # the weights are made on the device (fast); the resident copy of them is then a no-op
    base = ExpertWeights(rnd(e, 2 * i, h, scale=h**-0.5), rnd(e, h, i, scale=i**-0.5))
    experts = DeviceExperts(base, ResidentExperts(base, range(e), lora_rank=rank), None)
    experts.begin(dev)
    # where a run keeps this layer's LoRA (every expert on the device: there, ``lora_home``)
    on_device = lora_home(dev, True) is not None
    lora = [
        rnd(
            *sz, scale=0.01, dtype=torch.float32, on=dev if on_device else torch.device("cpu")
        ).requires_grad_()
        for sz in expert_lora_shapes(e, h, i, rank).values()
    ]
    x = rnd(t, h).requires_grad_()
    weights, ids = torch.rand(t, e, generator=gen, device=dev).topk(k, -1)
    weights = weights.to(bf).requires_grad_()
    grad = rnd(t, h, dtype=torch.float32)

    def run():
        local, _, w = experts.split(ids, weights)
        experts.start(x, local, w, lora, 2.0, on_device)().backward(grad)

    return t * k * shape.pair_flops(rank) / _best(run, 3, _sync(device))


def device_rates_on_cpu(rates: Rates, shape: LayerShape, tokens: int, rank: int = 8) -> Rates:
    """``rates`` with the link and GPU figures measured on the CPU device (not cached): the bench's
    CPU-only smoke run, where resident experts live on the CPU device, plans with them."""
    return Rates(
        rates.cpu_flops,
        measure_link_bytes_s(64 * 2**20, "cpu"),
        measure_gpu_flops(512, "cpu"),
        measure_gpu_expert_flops(shape, tokens, "cpu", rank),
        {
            **rates.source,
            "link_bytes_s": "CPU device",
            "gpu_flops": "CPU device",
            "gpu_expert_flops": "CPU device",
        },
    )


def _load_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(data: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:  # a read-only home must not stop a run: the figures are still used
        logger.warning(f"could not write the rates cache {path}: {e}")


def machine_rates(
    shape: LayerShape,
    backend: str,
    threads: int,
    tokens: int,
    rank: int = 8,
    remeasure: bool = False,
    overrides: dict[str, float] | None = None,
    cuda: bool | None = None,
) -> Rates:
    """The rates for ``shape`` on this machine: overrides, else the cache, else measured (and cached)."""
    overrides = overrides or {}
    cuda = torch.cuda.is_available() if cuda is None else cuda
    data = _load_cache()
    key = machine_key(cuda)
    entry = data.setdefault(key, {})
    src: dict[str, str] = {}
    changed = False

    def figure(name: str, sub: str | None, given: bool, measure: Callable[[], float]) -> float | None:
        nonlocal changed
        if given:
            return None  # apply_overrides fills it
        box = entry.setdefault(name, {}) if sub is not None else entry
        slot = sub if sub is not None else name
        if slot in box and not remeasure:
            src[name] = f"cached ({cache_path()})"
            return float(box[slot])
        t0 = time.perf_counter()
        value = measure()
        box[slot] = value
        changed = True
        src[name] = f"measured in {time.perf_counter() - t0:.1f} s"
        return value

    rows = rows_per_expert(shape, tokens)
    cpu_given = any(k.startswith("cpu_") for k in overrides)
    cpu_key = cpu_rate_key(shape, backend, threads, tokens)
    cpu = figure(
        "cpu_flops", cpu_key, cpu_given, lambda: measure_cpu_flops(shape, backend, threads, tokens, rank)
    )
    if src.get("cpu_flops", "").startswith("cached") and cpu_key in entry.get(RUN_SOURCE, {}):
        src["cpu_flops"] = f"cached from a training run ({cache_path()})"
    link = gpu = gpu_e = None
    if cuda:
        link = figure("link_bytes_s", None, "link_gbps" in overrides, measure_link_bytes_s)
        gpu = figure("gpu_flops", None, "gpu_tflops" in overrides, measure_gpu_flops)
        e_key = f"device layer fwd+bwd | E {shape.num_experts} H {shape.hidden} I {shape.inter} k {shape.top_k} r {rank} | {rows} rows"
        gpu_e = figure(
            "gpu_expert_flops",
            e_key,
            "gpu_expert_tflops" in overrides,
            lambda: measure_gpu_expert_flops(shape, tokens, rank=rank),
        )
    if changed:
        _save_cache(data)
    return apply_overrides(Rates(cpu, link, gpu, gpu_e, src), overrides, shape, rank)


def cached_cpu_flops(
    shape: LayerShape, backend: str, threads: int, tokens: int, rank: int = 8, cuda: bool | None = None
) -> tuple[float, str]:
    """The CPU op's FLOP/s for ``backend`` at ``shape`` from the cache slot ``machine_rates`` reads
    (``cpu_rate_key``), else measured (``measure_cpu_flops``) and cached; with where it came from."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    data = _load_cache()
    box = data.setdefault(machine_key(cuda), {}).setdefault("cpu_flops", {})
    key = cpu_rate_key(shape, backend, threads, tokens)
    if key in box:
        return float(box[key]), "cached"
    t0 = time.perf_counter()
    flops = measure_cpu_flops(shape, backend, threads, tokens, rank)
    box[key] = flops
    _save_cache(data)
    return flops, f"measured in {time.perf_counter() - t0:.1f} s"


def cpu_rate_key(shape: LayerShape, backend: str, threads: int, tokens: int) -> str:
    """The cache slot of the CPU op's rate: backend, threads, layer shape, rows per expert."""
    rows = rows_per_expert(shape, tokens)
    return f"{backend} | {threads} threads | H {shape.hidden} I {shape.inter} | {rows} rows"


RUN_SOURCE = "cpu_flops_from_run"  # cache entry: the CPU slots whose figure a training run measured


def remember_cpu_flops(cuda: bool, cpu_key: str, flops: float) -> None:
    """Keep the CPU op's rate as a training run measured it (``Replanner.calibrate``) in the cache
    slot ``cpu_key``, so the next run on this machine plans with it from its start: the op inside
    a step runs slower than alone (on an H200 host with kt-kernel: 0.37 TFLOP/s against 1.38)."""
    data = _load_cache()
    entry = data.setdefault(machine_key(cuda), {})
    entry.setdefault("cpu_flops", {})[cpu_key] = flops
    entry.setdefault(RUN_SOURCE, {})[cpu_key] = True
    _save_cache(data)


def describe(rates: Rates, shape: LayerShape, rank: int) -> list[str]:
    """One line per figure with where it came from, in the units of ``OVERRIDE_KEYS``."""
    lines = []
    if rates.cpu_flops:
        us = shape.top_k * shape.pair_flops(rank) / rates.cpu_flops * 1e6
        lines.append(
            f"CPU op {rates.cpu_flops / 1e12:.3g} TFLOP/s ({us:.1f} us a token of one layer) "
            f"[{rates.source.get('cpu_flops', '?')}]"
        )
    for name, label, scale, unit in (
        ("link_bytes_s", "link", 1e9, "GB/s"),
        ("gpu_flops", "GPU matmul", 1e12, "TFLOP/s"),
        ("gpu_expert_flops", "GPU experts", 1e12, "TFLOP/s"),
    ):
        v = getattr(rates, name)
        if v is not None:
            lines.append(f"{label} {v / scale:.3g} {unit} [{rates.source.get(name, '?')}]")
        elif name != "gpu_expert_flops":
            lines.append(f"{label}: unknown (no CUDA device here; give it with --rates)")
    if rates.nonexpert_s is not None:
        lines.append(
            f"non-expert work {rates.nonexpert_s * 1e3:.1f} ms a micro-batch [{rates.source.get('nonexpert_s', '?')}]"
        )
    return lines
