"""GFLOP/s of each native GEMM path this CPU runs, NT (forward) and NN (backward), against torch's
own bf16 and fp32 matmul at the same shapes in the same run: the CPU expert op's per-expert shapes
(``SHAPES``) and a dense one. Best of N single calls (the machine
may be shared).

    python -m kt_ft.integrations.bench.probes.native_gemm_probe [N] [THREADS]
"""

import sys

import torch

from kt_ft.backends import native as nt
from kt_ft.runtime.op_timing import best_time

# (M, W rows, W columns): an expert's rows at 512 tokens (DeepSeek-V2-Lite gate_up, down), at 2,048
# tokens (DeepSeek-V2-Lite gate_up: 192 rows; Qwen3-30B-A3B gate_up: 128 rows), and a dense one
SHAPES = [(48, 2816, 2048), (48, 2048, 1408), (192, 2816, 2048), (128, 1536, 2048), (3072, 2816, 2048)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    repeat = int(argv[0]) if len(argv) > 0 else 7
    threads = int(argv[1]) if len(argv) > 1 else 2
    torch.set_num_threads(threads)
    print(f"library {nt.library()._name}, best ISA {nt.best_isa()}, {threads} threads, best of {repeat}")
    for m, n, k in SHAPES:
        w = torch.randn(n, k).bfloat16()
        flops = 2 * m * n * k
        x, dy, out, dx = torch.randn(m, k), torch.randn(m, n), torch.empty(m, n), torch.empty(m, k)
        rates = {}
        for isa in nt.runnable_isas():
            if isa != "scalar":
                nt_s = best_time(lambda: nt.gemm_bf16_nt(x, w, out, threads=threads, isa=isa), repeat)
                nn_s = best_time(lambda: nt.gemm_bf16_nn(dy, w, dx, threads=threads, isa=isa), repeat)
                rates[isa] = (nt_s, nn_s)
        xb, dyb, wf = x.bfloat16(), dy.bfloat16(), w.float()
        rates["torch bf16"] = (best_time(lambda: xb @ w.T, repeat), best_time(lambda: dyb @ w, repeat))
        rates["torch fp32"] = (best_time(lambda: x @ wf.T, repeat), best_time(lambda: dy @ wf, repeat))
        cells = [
            f"{name}: NT {flops / a / 1e9:.0f} NN {flops / b / 1e9:.0f}" for name, (a, b) in rates.items()
        ]
        print(f"M={m} W=[{n},{k}] GFLOP/s  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
