"""`kt-ft bench`: the CPU expert op alone, every available backend, beside same-run GEMM ceilings.

For one MoE layer of a preset's real shape (random bf16 weights, LoRA r 8 with non-zero B), it
times forward-with-saved-state + backward at each token count and reports tokens/s and the
achieved TFLOP/s, counting 12*H*I*k FLOPs per token (the six base GEMMs; LoRA adds ~r/I more).
Ceilings, measured in the same run: one expert's bf16 product at the average rows per expert
(m = T*k/E), as a plain `x @ W.T` and (where oneDNN's bf16 path runs) prepacked; and torch fp32
GEMMs of the op's whole FLOP count (``fp32_ceiling``): at the op's own shapes (m rows against
[2I, H] weights, cycling over distinct weights as the op does over experts) and as one dense
[T*k, H] @ [H, 2I] product -- the rate a CPU without native bf16 could reach with an fp32 copy
of the weights. Each op's share of the first is printed under the table.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from kt_ft.backends.base import ExpertWeights
from kt_ft.backends.quant import FORMATS
from kt_ft.backends.quant_weights import QuantizedExperts
from kt_ft.backends.registry import BACKENDS, QUANTIZED_BACKENDS
from kt_ft.runtime.op_timing import Preset, best_time, random_layer, time_op

PRESETS = {
    "tiny": Preset("tiny", 256, 128, 8, 2, 2),
    "qwen3-30b-a3b": Preset("qwen3-30b-a3b", 2048, 768, 128, 8, 48),
    "deepseek-v2-lite": Preset("deepseek-v2-lite", 2048, 1408, 64, 6, 27),
    # 32 of the layer's 256 experts at top-1: each expert gets the real layer's rows (T * 8 / 256)
    # and its [4096, 7168] / [7168, 2048] weights, so the GEMMs are the real ones, in 1/8 of the
    # RAM (2.8 GB of bf16 experts instead of 22.5); tok/s are the slice's, TFLOP/s the layer's
    "deepseek-v3": Preset("deepseek-v3", 7168, 2048, 32, 1, 61),
}
# `--formats`: the layer's experts as stored (bf16, or kept quantized in a kt-ft format) for the op
OP_FORMATS = ("bf16", "fp8", "int8", "int4", "mxfp4")


@dataclass
class Record:
    name: str  # backend or ceiling name
    kind: str  # "op" | "gemm"
    preset: str
    tokens: int
    seconds: float
    tok_s: float | None
    tflops: float


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_op(
    p: Preset,
    layer,
    backend: str,
    tokens: int,
    threads: int,
    repeat: int,
    gen: torch.Generator,
    fmt: str = "bf16",
) -> Record:
    sec = time_op(p, layer, backend, tokens, threads, repeat, gen)
    flops = 12 * p.hidden * p.inter * p.top_k * tokens
    name = backend if fmt == "bf16" else f"{backend} {fmt}"
    return Record(name, "op", p.name, tokens, sec, tokens / sec, flops / sec / 1e12)


def quantized_layer(layer, fmt: str):
    """``layer``'s experts kept quantized in ``fmt`` as kt-ft loads them (gate_up as two parts, gate
    and up rows; down one part), its LoRA unchanged."""
    base, lora = layer
    f = FORMATS[fmt]
    return ExpertWeights(
        QuantizedExperts.from_dense(f, base.gate_up, 2), QuantizedExperts.from_dense(f, base.down)
    ), lora


def bench_gemm(p: Preset, tokens: int, threads: int, repeat: int, gen: torch.Generator) -> list[Record]:
    m = max(1, tokens * p.top_k // p.experts)
    x = torch.randn(m, p.hidden, generator=gen).to(torch.bfloat16)
    wt = torch.randn(p.inter, p.hidden, generator=gen).to(torch.bfloat16)
    flops = 2 * m * p.hidden * p.inter
    out = []
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    x @ wt.T
    # ~0.2 s a timing: 2000 reps took minutes where torch's bf16 matmul runs at ~1 GFLOP/s (AVX2)
    reps = max(1, min(2000 // max(1, m // 32), round(0.2 / max(time.perf_counter() - t0, 1e-6))))

    def plain():
        for _ in range(reps):
            x @ wt.T

    sec = best_time(plain, repeat) / reps
    out.append(Record(f"gemm x@W.T m={m}", "gemm", p.name, tokens, sec, None, flops / sec / 1e12))
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(wt, m)

        def prepacked():
            for _ in range(reps):
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

        sec = best_time(prepacked, repeat) / reps
        out.append(Record(f"gemm prepacked m={m}", "gemm", p.name, tokens, sec, None, flops / sec / 1e12))
    except RuntimeError as e:  # oneDNN's bf16 path needs AVX512-BF16/AMX or AVX-NE-CONVERT
        print(f"prepacked bf16 GEMM unavailable here: {str(e).splitlines()[0]}")
    return out


def fp32_ceiling(p: Preset, tokens: int, threads: int, repeat: int, gen: torch.Generator) -> list[Record]:
    """torch fp32 GEMMs doing the op's FLOPs (12 H I k per token) at its shapes, and dense."""
    torch.set_num_threads(threads)
    total = 12 * p.hidden * p.inter * p.top_k * tokens
    m = max(1, tokens * p.top_k // p.experts)
    # distinct weights past the last-level cache, as the op streams its experts' weights
    n_w = max(1, min(p.experts, (256 << 20) // (8 * p.inter * p.hidden)))
    ws = [torch.randn(2 * p.inter, p.hidden, generator=gen) for _ in range(n_w)]
    x = torch.randn(m, p.hidden, generator=gen)
    reps = max(1, round(total / (4 * m * p.inter * p.hidden)))

    def shaped():
        for i in range(reps):
            x @ ws[i % n_w].T

    out = []
    for w in ws:  # warm-up: one product per weight (the whole run once would double the cost)
        x @ w.T
    sec = min(_timed(shaped) for _ in range(max(1, repeat)))
    out.append(Record(f"gemm fp32 m={m} (op FLOPs)", "gemm", p.name, tokens, sec, None, total / sec / 1e12))
    xd = torch.randn(tokens * p.top_k, p.hidden, generator=gen)
    reps_d = max(1, round(total / (4 * tokens * p.top_k * p.inter * p.hidden)))

    def dense():
        for _ in range(reps_d):
            xd @ ws[0].T

    sec = best_time(dense, repeat)
    out.append(
        Record(f"gemm fp32 m={tokens * p.top_k} dense", "gemm", p.name, tokens, sec, None, total / sec / 1e12)
    )
    return out


def available_backends(asked: list[str] | None) -> list[str]:
    """The asked backends (default: every registered one) that can run here; the others are
    skipped with their reason printed."""
    names = []
    for n in asked or list(BACKENDS):
        reason = BACKENDS[n].unavailable_reason(torch.bfloat16) if n in BACKENDS else "unknown backend"
        if reason is None:
            names.append(n)
        else:
            print(f"skipping backend {n}: {reason}")
    return names


def run(
    preset: str,
    tokens: list[int],
    backends: list[str],
    threads: int,
    repeat: int,
    formats: tuple[str, ...] = ("bf16",),
) -> list[Record]:
    p = PRESETS[preset]
    gen = torch.Generator().manual_seed(0)
    names = list(backends)
    records: list[Record] = []
    layer = random_layer(p, 8, gen) if names else None
    layers = {f: layer if f == "bf16" else quantized_layer(layer, f) for f in formats} if names else {}
    jobs = [
        (t, n, f) for t in tokens for f in formats for n in names if f == "bf16" or n in QUANTIZED_BACKENDS
    ]
    jobs += [(t, "gemm", "bf16") for t in tokens]
    for t, n, f in tqdm(jobs, desc=f"bench {preset}", unit="case"):
        if n == "gemm":
            records.extend(bench_gemm(p, t, threads, repeat, gen))
            records.extend(fp32_ceiling(p, t, threads, repeat, gen))
        elif n == "reference" and t * p.top_k > 8192 * 4 and preset != "tiny":
            continue  # the plain loop at this size takes minutes and adds nothing
        else:
            try:
                records.append(bench_op(p, layers[f], n, t, threads, repeat, gen, fmt=f))
            except Exception as e:  # one broken backend must not hide the others' figures
                print(f"backend {n} ({f}) failed at {t} tokens: {type(e).__name__}: {e}")
    print(
        f"\n{preset}: H {p.hidden}, I {p.inter}, E {p.experts}, top-{p.top_k}, one layer, {threads} threads, fwd+bwd"
    )
    print(f"{'name':<32}{'tokens':>8}{'ms':>10}{'tok/s':>10}{'TFLOP/s':>9}")
    for r in records:
        tok = f"{r.tok_s:,.0f}" if r.tok_s else "-"
        print(f"{r.name:<32}{r.tokens:>8}{r.seconds * 1e3:>10.2f}{tok:>10}{r.tflops:>9.3f}")
    ceiling = {r.tokens: r for r in records if r.name.endswith("(op FLOPs)")}
    for r in records:
        if r.kind == "op" and r.tokens in ceiling:
            c = ceiling[r.tokens]
            print(f"{r.name} at {r.tokens} tokens: {r.tflops / c.tflops:.2f}x the same-run {c.name}")
    for line in format_ratios(records):
        print(line)
    return records


def format_ratios(records: list[Record]) -> list[str]:
    """Each quantized op against the same backend on bf16 and against torch on the same format,
    same run, same tokens (the ratios of throughput)."""
    rate = {(r.name, r.tokens): r.tok_s for r in records if r.kind == "op"}
    lines = []
    for (name, t), v in rate.items():
        if " " not in name:
            continue
        backend, fmt = name.split(" ", 1)
        parts = []
        if (backend, t) in rate:
            parts.append(f"{v / rate[(backend, t)]:.2f}x {backend} bf16")
        if backend != "torch" and (f"torch {fmt}", t) in rate:
            parts.append(f"{v / rate[(f'torch {fmt}', t)]:.2f}x torch {fmt}")
        if parts:
            lines.append(f"{name} at {t} tokens: {', '.join(parts)}")
    return lines


def write_json(path: str, threads: int, records: list) -> None:
    """All records (op, gemm, step) with the machine's facts: every ratio computable from the file."""
    meta = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": threads,
    }
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
    with open(path, "w") as f:
        json.dump({"meta": meta, "records": [asdict(r) for r in records]}, f, indent=1)
