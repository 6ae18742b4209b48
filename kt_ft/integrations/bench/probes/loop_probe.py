"""The expert op's per-expert products in a real loop (128 experts, cold weights): which form is fast?

python -m kt_ft.integrations.bench.probes.loop_probe
"""

import time

import torch

E, H, I, R, n = 128, 2048, 768, 8, 256
bf = torch.bfloat16
N = E * n


def loop(f):
    f(0)
    t0 = time.perf_counter()
    for e in range(E):
        f(e)
    return (time.perf_counter() - t0) * 1e3


def sl(e):
    return slice(e * n, (e + 1) * n)


def main() -> None:
    torch.set_num_threads(16)
    Wgu = torch.randn(E, 2 * I, H, dtype=bf)
    Wd = torch.randn(E, H, I, dtype=bf)
    Bd = torch.randn(E, H, R, dtype=bf)
    Agu = torch.randn(E, 2 * R, H, dtype=bf)
    h = torch.randn(N, I, dtype=bf)
    dgu = torch.randn(N, 2 * I, dtype=bf)
    pd = torch.randn(N, R, dtype=bf)
    dp = torch.randn(N, 2 * R, dtype=bf)
    out = torch.empty(N, H, dtype=bf)
    out32 = torch.empty(N, H)
    cases = {
        "d = h@Wd[e].t() out=": lambda e: torch.mm(h[sl(e)], Wd[e].t(), out=out[sl(e)]),
        "d = h@Wd[e].t() alloc": lambda e: torch.mm(h[sl(e)], Wd[e].t()),
        "d = F.linear(h, Wd[e])": lambda e: torch.nn.functional.linear(h[sl(e)], Wd[e]),
        "dx = dgu@Wgu[e] out=": lambda e: torch.mm(dgu[sl(e)], Wgu[e], out=out[sl(e)]),
        "dx = dgu@Wgu[e] alloc": lambda e: torch.mm(dgu[sl(e)], Wgu[e]),
        "lo = pd@Bd[e].t() out=": lambda e: torch.mm(pd[sl(e)], Bd[e].t(), out=out[sl(e)]),
        "lo = pd@Bd[e].t() alloc": lambda e: torch.mm(pd[sl(e)], Bd[e].t()),
        "lo = pd@Bd[e].t() fp32": lambda e: torch.mm(pd[sl(e)].float(), Bd[e].t().float()),
        "lo = dp@Agu[e] out=": lambda e: torch.mm(dp[sl(e)], Agu[e], out=out[sl(e)]),
        "lo = dp@Agu[e] alloc": lambda e: torch.mm(dp[sl(e)], Agu[e]),
        "lo = dp@Agu[e] fp32": lambda e: torch.mm(dp[sl(e)].float(), Agu[e].float()),
        "lo = dp@Agu[e] fp32 out=": lambda e: torch.mm(dp[sl(e)].float(), Agu[e].float(), out=out32[sl(e)]),
    }
    for name, f in cases.items():
        print(f"{name:<32}{loop(f):>9.1f} ms for {E} experts")
    # the whole LoRA-up for all experts as one padded bmm (fp32 and bf16)
    P = dp.view(E, n, 2 * R)
    for dt in (bf, torch.float32):
        Pa, Aa = P.to(dt), Agu.to(dt)
        torch.bmm(Pa, Aa)
        t0 = time.perf_counter()
        torch.bmm(Pa, Aa)
        print(f"bmm [E,n,2r]x[E,2r,H] {dt}        {(time.perf_counter() - t0) * 1e3:>9.1f} ms")


if __name__ == "__main__":
    main()
