"""Profile one fwd+bwd of a CPU expert backend at a preset's real shape (torch.profiler, top ops,
then matmul time by product kind).

    python -m kt_ft.integrations.bench.probes.profile_op [--preset qwen3-30b-a3b] [--tokens 4096]
        [--backend torch] [--threads N]
"""

import argparse
import time

import torch

from kt_ft.integrations.bench.op import PRESETS, random_layer
from kt_ft.runtime.op_timing import op_step

# matmul time by op and product kind: dims other than E, H, I, 2I, r, 2r are a row count n
# (per expert for mm; the padded per-expert rows for the grouped bmm / baddbmm_)
MATMULS = ("aten::mm", "aten::bmm", "aten::baddbmm_")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    p = PRESETS[a.preset]
    gen = torch.Generator().manual_seed(0)
    step = op_step(
        p, random_layer(p, 8, gen), a.backend, a.tokens, a.threads, gen
    )  # returns the backward's s

    step()
    t0 = time.perf_counter()
    tb = step()
    print(
        f"{a.backend} {a.tokens} tokens: fwd+bwd {1e3 * (time.perf_counter() - t0):.1f} ms (bwd {1e3 * tb:.1f} ms)"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))

    known = {p.experts, p.hidden, p.inter, 2 * p.inter, 8, 16}
    by_kind: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.name in MATMULS and ev.input_shapes:
            shapes = ev.input_shapes[1:3] if ev.name == "aten::baddbmm_" else ev.input_shapes[:2]  # past self
            kind = (
                ev.name.removeprefix("aten::")
                + " "
                + " x ".join("[" + ",".join(str(d) if d in known else "n" for d in s) + "]" for s in shapes)
            )
            by_kind.setdefault(kind, []).append(ev.cpu_time_total / 1e3)
    print(f"{'matmul kind':<48}{'calls':>7}{'total ms':>10}{'avg ms':>9}")
    for kind, ts in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        print(f"{kind:<48}{len(ts):>7}{sum(ts):>10.1f}{sum(ts) / len(ts):>9.3f}")


if __name__ == "__main__":
    main()
