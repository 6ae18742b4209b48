"""Profile one fwd+bwd of a CPU expert backend at a preset's real shape (torch.profiler, top ops).

python3 scripts/profile_op.py [--preset qwen3-30b-a3b] [--tokens 4096] [--backend torch] [--threads N]
"""

import argparse
import time

import torch

from kt_ft.bench import PRESETS, random_layer
from kt_ft.kernels import BACKENDS
from kt_ft.moe.function import CPUExpertsFunction, ExpertRunner

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="qwen3-30b-a3b")
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--backend", default="torch")
ap.add_argument("--threads", type=int, default=torch.get_num_threads())
a = ap.parse_args()
torch.set_num_threads(a.threads)
p = PRESETS[a.preset]
gen = torch.Generator().manual_seed(0)
base, lora = random_layer(p, 8, gen)
x = torch.randn(a.tokens, p.hidden, generator=gen).bfloat16()
w, ids = torch.rand(a.tokens, p.experts, generator=gen).topk(p.top_k, -1)
w = w.bfloat16()
gy = torch.randn_like(x)
runner = ExpertRunner(BACKENDS[a.backend](), base, 2.0, a.tokens, a.threads)
params = [t.clone().requires_grad_() for t in lora]


def step():
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = CPUExpertsFunction.apply(xx, ids, ww, runner, *params)
    t0 = time.perf_counter()
    out.backward(gy)
    return time.perf_counter() - t0


step()
t0 = time.perf_counter()
tb = step()
print(f"{a.backend} {a.tokens} tokens: fwd+bwd {1e3 * (time.perf_counter() - t0):.1f} ms (bwd {1e3 * tb:.1f} ms)")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
    step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))
