"""`kt-ft bench`: the CPU expert op alone, every available backend, beside same-run GEMM ceilings.

For one MoE layer of a preset's real shape (random bf16 weights, LoRA r 8 with non-zero B), it
times forward-with-saved-state + backward at each token count and reports tokens/s and the
achieved TFLOP/s, counting 12*H*I*k FLOPs per token (the six base GEMMs; LoRA adds ~r/I more).
Ceilings, measured in the same run: one expert's bf16 product at the average rows per expert
(m = T*k/E), as a plain `x @ W.T` and (where oneDNN's bf16 path runs) prepacked.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from ..kernels import BACKENDS
from ..moe.op_timing import Preset, best_time, random_layer, time_op

PRESETS = {
    "tiny": Preset("tiny", 256, 128, 8, 2, 2),
    "qwen3-30b-a3b": Preset("qwen3-30b-a3b", 2048, 768, 128, 8, 48),
    "deepseek-v2-lite": Preset("deepseek-v2-lite", 2048, 1408, 64, 6, 27),
}


@dataclass
class Record:
    name: str  # backend or ceiling name
    kind: str  # "op" | "gemm"
    preset: str
    tokens: int
    seconds: float
    tok_s: float | None
    tflops: float


def bench_op(
    p: Preset, layer, backend: str, tokens: int, threads: int, repeat: int, gen: torch.Generator
) -> Record:
    sec = time_op(p, layer, backend, tokens, threads, repeat, gen)
    flops = 12 * p.hidden * p.inter * p.top_k * tokens
    return Record(backend, "op", p.name, tokens, sec, tokens / sec, flops / sec / 1e12)


def bench_gemm(p: Preset, tokens: int, threads: int, repeat: int, gen: torch.Generator) -> list[Record]:
    m = max(1, tokens * p.top_k // p.experts)
    x = torch.randn(m, p.hidden, generator=gen).to(torch.bfloat16)
    wt = torch.randn(p.inter, p.hidden, generator=gen).to(torch.bfloat16)
    flops = 2 * m * p.hidden * p.inter
    reps = max(1, 2000 // max(1, m // 32))
    out = []
    torch.set_num_threads(threads)

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
) -> list[Record]:
    p = PRESETS[preset]
    gen = torch.Generator().manual_seed(0)
    names = list(backends)
    records: list[Record] = []
    layer = random_layer(p, 8, gen) if names else None
    jobs = [(t, n) for t in tokens for n in [*names, "gemm"]]
    for t, n in tqdm(jobs, desc=f"bench {preset}", unit="case"):
        if n == "gemm":
            records.extend(bench_gemm(p, t, threads, repeat, gen))
        elif n == "reference" and t * p.top_k > 8192 * 4 and preset != "tiny":
            continue  # the plain loop at this size takes minutes and adds nothing
        else:
            try:
                records.append(bench_op(p, layer, n, t, threads, repeat, gen))
            except Exception as e:  # one broken backend must not hide the others' figures
                print(f"backend {n} failed at {t} tokens: {type(e).__name__}: {e}")
    print(
        f"\n{preset}: H {p.hidden}, I {p.inter}, E {p.experts}, top-{p.top_k}, one layer, {threads} threads, fwd+bwd"
    )
    print(f"{'name':<28}{'tokens':>8}{'ms':>10}{'tok/s':>10}{'TFLOP/s':>9}")
    for r in records:
        tok = f"{r.tok_s:,.0f}" if r.tok_s else "-"
        print(f"{r.name:<28}{r.tokens:>8}{r.seconds * 1e3:>10.2f}{tok:>10}{r.tflops:>9.3f}")
    return records


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
