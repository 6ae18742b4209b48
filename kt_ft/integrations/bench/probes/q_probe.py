"""Does the backward's per-expert dY·Wd product (``grouped.py``: q = gy @ Wd) take a slow path with
``out=``? Times it with ``out=`` into a row slice and as an assignment, one Qwen3-30B-A3B layer
(H 2048, I 768, 128 experts) at m rows an expert. ``bmm_probe`` measured that product's
loop at 1.1 TFLOP/s under uniform routing (224-304 rows an expert) on the GPU machine's Xeon,
against 2.1-2.7 for every other formulation; the forward's down product measured 2.5x slower
with ``out=`` and assigns instead (``grouped.py``).

    python -m kt_ft.integrations.bench.probes.q_probe [--threads N]
"""

import argparse
import time

import torch

H, I, E = 2048, 768, 128
bf = torch.bfloat16


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    torch.set_num_threads(ap.parse_args(argv).threads)
    Wd = torch.randn(E, H, I, dtype=bf)
    for m in (224, 240, 256, 272, 288, 304, 512, 1024):
        gy = torch.randn(m * E, H, dtype=bf)
        q = torch.empty(m * E, I, dtype=bf)

        def with_out(gy=gy, q=q, m=m):
            for e in range(E):
                torch.mm(gy[e * m : (e + 1) * m], Wd[e], out=q[e * m : (e + 1) * m])

        def assign(gy=gy, q=q, m=m):
            for e in range(E):
                q[e * m : (e + 1) * m] = torch.mm(gy[e * m : (e + 1) * m], Wd[e])

        res = []
        for f in (with_out, assign):
            f()
            t = time.perf_counter()
            f()
            f()
            res.append((time.perf_counter() - t) / 2)
        flops = 2 * m * E * H * I
        print(f"m {m}: out= {flops / res[0] / 1e12:.2f} TFLOP/s, assign {flops / res[1] / 1e12:.2f}")


if __name__ == "__main__":
    main()
