"""Time one CPU expert op call (forward + backward) at a preset's shape, with the page faults and
system time it costs (fresh large allocations fault once per 4 KiB page at their first write).
``kt-ft bench --parts op`` times the same call; this adds what it costs the kernel.

    python -m kt_ft.integrations.bench.probes.op_faults [--preset deepseek-v2-lite] [--tokens 2048]
        [--backend native] [--threads N] [--runs 3]
"""

import argparse
import resource
import time

import torch

from kt_ft.integrations.bench.op import PRESETS, random_layer
from kt_ft.runtime.op_timing import op_step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--backend", default="native")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    p = PRESETS[a.preset]
    gen = torch.Generator().manual_seed(0)
    step = op_step(p, random_layer(p, 8, gen), a.backend, a.tokens, a.threads, gen)

    step()  # first call: buffers made, kernels built
    for _ in range(a.runs):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step()
        ms, r1 = 1e3 * (time.perf_counter() - t0), resource.getrusage(resource.RUSAGE_SELF)
        print(
            f"{a.backend} {a.preset} {a.tokens} tokens, {a.threads} threads: {ms:.0f} ms, "
            f"{r1.ru_minflt - r0.ru_minflt} page faults, system {r1.ru_stime - r0.ru_stime:.2f} s, "
            f"user {r1.ru_utime - r0.ru_utime:.2f} s"
        )


if __name__ == "__main__":
    main()
