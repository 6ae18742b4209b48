"""Per-expert GEMM loop vs batched formulations for the expert op's four big products.

One Qwen3-30B-A3B MoE layer (E 128, H 2048, I 768, top-8) at T tokens, rows padded to 16 per
expert as the torch backend lays them out. For each product kind (fwd gate_up x W^T, fwd down
h Wd^T, bwd dx dgu W, bwd q gy Wd) it times:
  loop       one torch.mm per expert (what the torch backend does now);
  range G    experts in id order cut into runs of G ids, each run's rows padded to the run's
             largest count, one torch.bmm a run with the weights as a view (no copy);
  sorted G   experts sorted by count, the weights gathered in that order (the copy is timed
             with it), runs of G padded to their largest count, one bmm a run;
  prepacked  one oneDNN prepacked linear per expert (packing excluded; needs a second packed
             copy of every weight, so a ceiling, not a plan).
TFLOP/s count useful rows only (padding is waste). Routing: uniform (the bench's random layer)
and skewed (Zipf-like popularity, as trained routers have).

    python -m kt_ft.integrations.bench.probes.bmm_probe [--tokens 2048,4096] [--threads N]
"""

import argparse
import time

import torch

E, H, I, K, PAD = 128, 2048, 768, 8, 16
bf = torch.bfloat16


def timed(f, n=3):
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def routing_counts(tokens: int, skew: bool, gen: torch.Generator) -> list[int]:
    if skew:
        # Gumbel top-k: k experts a token drawn without replacement with P ~ popularity i^-0.5
        # (the most popular expert gets ~5x the mean count)
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 0.5
        pop = pop[torch.randperm(E, generator=gen)]
        u = torch.rand(tokens, E, generator=gen).clamp_min(1e-9)
        logits = torch.log(pop).float() - torch.log(-torch.log(u))
    else:
        logits = torch.rand(tokens, E, generator=gen)
    ids = logits.topk(K, -1).indices
    return torch.bincount(ids.reshape(-1), minlength=E).tolist()


def pad(c: int) -> int:
    return (c + PAD - 1) // PAD * PAD


def runs(order: list[int], counts: list[int], g: int):
    """[(experts, rows each)] for runs of g experts in ``order``, each padded to the run's max."""
    out = []
    for i in range(0, len(order), g):
        es = order[i : i + g]
        out.append((es, max(pad(counts[e]) for e in es)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    w_gu = torch.randn(E, 2 * I, H, dtype=bf)  # HF layout [E, 2I, H]
    w_d = torch.randn(E, H, I, dtype=bf)  # [E, H, I]
    # kind: (weight [E, out?, in?], input cols, output cols, weight as used: "t" (x W^T) or "n" (x W))
    kinds = {
        "fwd gu  x W^T": (w_gu, H, 2 * I, "t"),
        "fwd d   h Wd^T": (w_d, I, H, "t"),
        "bwd dx  dgu W": (w_gu, 2 * I, H, "n"),
        "bwd q   gy Wd": (w_d, H, I, "n"),
    }
    print(f"threads {a.threads}")
    for tokens in [int(t) for t in a.tokens.split(",")]:
        for skew in (False, True):
            counts = routing_counts(tokens, skew, gen)
            padded = [pad(c) for c in counts]
            n_rows = sum(padded)
            useful = sum(counts)
            print(
                f"--- {tokens} tokens, {'skewed' if skew else 'uniform'} routing: counts min {min(counts)} "
                f"max {max(counts)}, {n_rows} padded rows"
            )
            for name, (w, cin, cout, how) in kinds.items():
                flops = 2 * useful * cin * cout
                x = torch.randn(n_rows, cin, dtype=bf)
                y = torch.empty(n_rows, cout, dtype=bf)
                offs, off = [], 0
                for p_ in padded:
                    offs.append(off)
                    off += p_

                def wt(e0: int, e1: int):  # weights of experts e0..e1-1 as used: [n, cin, cout]
                    return w[e0:e1].transpose(1, 2) if how == "t" else w[e0:e1]

                def loop():
                    for e in range(E):
                        if padded[e]:
                            sl = slice(offs[e], offs[e] + padded[e])
                            torch.mm(x[sl], wt(e, e + 1)[0], out=y[sl])

                res = {"loop": timed(loop)}
                for g in (8, 32):
                    rr = runs(list(range(E)), counts, g)
                    rows = sum(len(es) * c for es, c in rr)
                    xb = torch.randn(rows, cin, dtype=bf)
                    yb = torch.empty(rows, cout, dtype=bf)

                    def ranged(rr=rr, xb=xb, yb=yb, g=g):
                        o = 0
                        for i, (es, c) in enumerate(rr):
                            n = len(es) * c
                            e0 = i * g
                            torch.bmm(
                                xb[o : o + n].view(len(es), c, cin),
                                wt(e0, e0 + len(es)),
                                out=yb[o : o + n].view(len(es), c, cout),
                            )
                            o += n

                    res[f"range {g} (+{100 * (rows - useful) / useful:.0f}% rows)"] = timed(ranged)
                order = sorted(range(E), key=lambda e: counts[e])
                idx = torch.tensor(order)
                wbuf = torch.empty_like(w)
                for g in (16,):
                    rr = runs(order, counts, g)
                    rows = sum(len(es) * c for es, c in rr)
                    xb = torch.randn(rows, cin, dtype=bf)
                    yb = torch.empty(rows, cout, dtype=bf)

                    def sorted_(rr=rr, xb=xb, yb=yb, g=g):
                        torch.index_select(w, 0, idx, out=wbuf)
                        o = 0
                        for i, (es, c) in enumerate(rr):
                            n = len(es) * c
                            e0 = i * g
                            ws = wbuf[e0 : e0 + len(es)]
                            torch.bmm(
                                xb[o : o + n].view(len(es), c, cin),
                                ws.transpose(1, 2) if how == "t" else ws,
                                out=yb[o : o + n].view(len(es), c, cout),
                            )
                            o += n

                    res[f"sorted {g} +copy (+{100 * (rows - useful) / useful:.0f}% rows)"] = timed(sorted_)
                try:
                    packed = []
                    for e in range(E):
                        we = w[e] if how == "t" else w[e].t().contiguous()  # linear wants [out, in]
                        packed.append(torch.ops.mkldnn._reorder_linear_weight(we, max(padded[e], 1)))

                    def prepacked():
                        for e in range(E):
                            if padded[e]:
                                sl = slice(offs[e], offs[e] + padded[e])
                                torch.ops.mkldnn._linear_pointwise(x[sl], packed[e], None, "none", [], "")

                    res["prepacked"] = timed(prepacked)
                except (RuntimeError, AttributeError) as exc:
                    print(f"  prepacked unavailable: {str(exc).splitlines()[0]}")
                cells = "  ".join(f"{k} {1e3 * s:.1f} ms {flops / s / 1e12:.2f}" for k, s in res.items())
                print(f"  {name}: {cells}")


if __name__ == "__main__":
    main()
