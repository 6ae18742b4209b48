"""GFLOP/s of the native grouped GEMMs at the CPU expert op's own call (every expert of a
DeepSeek-V2-Lite layer at once: 64 experts x ROWS rows, 2,048 tokens top-6 = 192 rows an expert)
against the thread count: does the op's product scale over the cores, and where does it stop?
One line per (ISA, product, direction), one column per thread count, torch's bf16 bmm beside it.

    python -m kt_ft.integrations.bench.probes.grouped_scaling_probe [THREADS,...] [ROWS] [REPEAT]
"""

import sys

import torch

from kt_ft.backends import native as nt
from kt_ft.runtime.op_timing import best_time

EXPERTS = 64
SHAPES = {"gate_up": (2816, 2048), "down": (2048, 1408)}  # W [N, K] of one expert


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    threads = [int(t) for t in (argv[0] if len(argv) > 0 else "1,2,4,8,14").split(",")]
    rows = int(argv[1]) if len(argv) > 1 else 192
    repeat = int(argv[2]) if len(argv) > 2 else 3
    torch.manual_seed(0)
    print(
        f"library {nt.library()._name}, best ISA {nt.best_isa()}, {EXPERTS} experts x {rows} rows, "
        f"threads {threads}, best of {repeat}"
    )
    plan = torch.tensor([(e, e * rows, rows) for e in range(EXPERTS)], dtype=torch.int64).t().contiguous()
    for name, (n, k) in SHAPES.items():
        w = torch.randn(EXPERTS, n, k).bfloat16()
        flops = 2 * EXPERTS * rows * n * k
        for trans in (True, False):
            kin, nout = (k, n) if trans else (n, k)
            a, out = torch.randn(EXPERTS * rows, kin), torch.empty(EXPERTS * rows, nout)
            for isa in [i for i in nt.runnable_isas() if i not in ("scalar", "avx2")]:
                cells = []
                for t in threads:
                    s = best_time(
                        lambda: nt.grouped_bf16(
                            trans, a, w, out, plan[0], plan[1], plan[2], threads=t, isa=isa
                        ),
                        repeat,
                    )
                    cells.append(f"{t}t {flops / s / 1e9:6.0f}")
                print(f"{name:8s} {'NT' if trans else 'NN'} {isa:11s} " + "  ".join(cells), flush=True)
            ab = a.view(EXPERTS, rows, kin).bfloat16()
            wt = w.transpose(1, 2) if trans else w
            cells = []
            for t in threads:
                torch.set_num_threads(t)
                cells.append(f"{t}t {flops / best_time(lambda: torch.bmm(ab, wt), repeat) / 1e9:6.0f}")
            print(f"{name:8s} {'NT' if trans else 'NN'} {'torch bmm':11s} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
