"""Which bf16 GEMM formulation is fast on this CPU? Times every orientation the expert op needs.

Shapes: one Qwen3-30B-A3B expert (H 2048, I 768, r 8) at m rows (tokens routed to it).

    python -m kt_ft.integrations.bench.probes.gemm_probe
"""

import time

import torch
import torch.nn.functional as F

H, I, R = 2048, 768, 8
bf = torch.bfloat16


def t(f, n=30):
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def row(name, ms, flop):
    print(f"{name:<58}{ms:>9.3f} ms{flop / ms / 1e9:>8.2f} TFLOP/s")


def main() -> None:
    for m in (32, 256):
        print(f"--- m = {m}")
        x = torch.randn(m, H, dtype=bf)
        gu = torch.randn(m, 2 * I, dtype=bf)
        h = torch.randn(m, I, dtype=bf)
        Wgu = torch.randn(2 * I, H, dtype=bf)  # [2I, H] HF layout
        Wd = torch.randn(H, I, dtype=bf)  # [H, I] HF layout
        WguT = Wgu.t().contiguous()  # [H, 2I]
        WdT = Wd.t().contiguous()  # [I, H]
        out = torch.empty(m, H, dtype=bf)
        f_gu = 2 * m * H * 2 * I
        f_d = 2 * m * H * I
        row("fwd gu: x @ Wgu.T (mm, linear layout)", t(lambda: torch.mm(x, Wgu.t())), f_gu)
        row("fwd gu: F.linear(x, Wgu)", t(lambda: F.linear(x, Wgu)), f_gu)
        row("fwd d: h @ Wd.T (mm)", t(lambda: torch.mm(h, Wd.t())), f_d)
        row("fwd d: F.linear(h, Wd)", t(lambda: F.linear(h, Wd)), f_d)
        row("fwd d: mm(h, Wd.t(), out=)", t(lambda: torch.mm(h, Wd.t(), out=out)), f_d)
        row("bwd dx: dgu @ Wgu (non-transposed B)", t(lambda: torch.mm(gu, Wgu)), f_gu)
        row("bwd dx: F.linear(dgu, WguT) (transposed copy)", t(lambda: F.linear(gu, WguT)), f_gu)
        row("bwd dx: (Wgu.T @ dgu.T).T", t(lambda: torch.mm(Wgu.t(), gu.t()).t()), f_gu)
        row("bwd q: gy @ Wd (non-transposed B)", t(lambda: torch.mm(x, Wd)), f_d)
        row("bwd q: F.linear(gy, WdT) (transposed copy)", t(lambda: F.linear(x, WdT)), f_d)
        row("bwd q: (Wd.T @ gy.T).T", t(lambda: torch.mm(Wd.t(), x.t()).t()), f_d)
        row("bwd dx fp32: dgu.float() @ Wgu.float()", t(lambda: torch.mm(gu.float(), Wgu.float()), 5), f_gu)
        try:
            pk = torch.ops.mkldnn._reorder_linear_weight(Wgu, m)
            row(
                "fwd gu prepacked",
                t(lambda: torch.ops.mkldnn._linear_pointwise(x, pk, None, "none", [], "")),
                f_gu,
            )
            pkT = torch.ops.mkldnn._reorder_linear_weight(WguT, m)
            row(
                "bwd dx prepacked (of WguT)",
                t(lambda: torch.ops.mkldnn._linear_pointwise(gu, pkT, None, "none", [], "")),
                f_gu,
            )
            pkd = torch.ops.mkldnn._reorder_linear_weight(Wd, m)
            row(
                "fwd d prepacked",
                t(lambda: torch.ops.mkldnn._linear_pointwise(h, pkd, None, "none", [], "")),
                f_d,
            )
        except RuntimeError as e:
            print("prepack unavailable:", e)
        # LoRA-sized products
        A = torch.randn(2 * R, H, dtype=bf)
        P = torch.randn(m, 2 * R, dtype=bf)
        B = torch.randn(I, R, dtype=bf)
        for dt in (bf, torch.float32):
            xa, Aa, Pa, Ba, ga = x.to(dt), A.to(dt), P.to(dt), B.to(dt), gu[:, :I].to(dt)
            tag = "bf16" if dt == bf else "fp32"
            row(f"lora {tag}: x @ A.T [m,H]x[H,2r]", t(lambda: xa @ Aa.t()), 2 * m * H * 2 * R)
            row(f"lora {tag}: P @ B.T [m,r]x[r,I]", t(lambda: Pa[:, :R] @ Ba.t()), 2 * m * R * I)
            row(f"lora {tag}: dP.T @ x [2r,m]x[m,H]", t(lambda: Pa.t() @ xa), 2 * m * H * 2 * R)
            row(f"lora {tag}: dP @ A [m,2r]x[2r,H]", t(lambda: Pa @ Aa), 2 * m * H * 2 * R)
            row(f"lora {tag}: dg.T @ P [I,m]x[m,r]", t(lambda: ga.t() @ Pa[:, :R]), 2 * m * R * I)
            row(f"lora {tag}: dg @ B [m,I]x[I,r]", t(lambda: ga @ Ba), 2 * m * R * I)

    print("--- memory-bound, N = 32768 pairs")
    N, T = 32768, 4096
    xs = torch.randn(T, H, dtype=bf)
    idx = torch.randint(0, T, (N,))
    big = torch.randn(N, H, dtype=bf)
    row("index_select [T,H]->[N,H] bf16", t(lambda: xs.index_select(0, idx), 5), 1e-9)
    acc = torch.zeros(T, H)
    row("index_add_ fp32 [N,H]->[T,H]", t(lambda: acc.index_add_(0, idx, big.float()), 5), 1e-9)
    row("index_add_ bf16->fp32 via .float()", t(lambda: big.float(), 5), 1e-9)
    gu_big = torch.randn(N, 2 * I, dtype=bf)
    row(
        "silu(g)*u in fp32 [N,I]",
        t(lambda: (F.silu(gu_big[:, :I].float()) * gu_big[:, I:].float()).to(bf), 5),
        1e-9,
    )
    row("silu(g)*u in bf16 [N,I]", t(lambda: F.silu(gu_big[:, :I]) * gu_big[:, I:], 5), 1e-9)


if __name__ == "__main__":
    main()
