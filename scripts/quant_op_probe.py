"""The CPU expert op (``torch`` backend) on experts kept quantized against the same experts dense:
one Qwen3-30B-A3B layer (H 2048, I 768, 128 experts, top-8, LoRA rank 8), forward + backward, the
third of three runs timed; the ratio is the quantized formats' cost of dequantizing inside the op
(``kernels/grouped.py``'s chunks, ``kernels/dequant.cpp``). fp32 by default (CPUs without native
bf16); ``--dtype bf16`` where bf16 GEMMs are native.

python3 scripts/quant_op_probe.py [--tokens 2048] [--threads N] [--dtype fp32|bf16]
"""

import argparse
import time

import torch

from kt_ft.backends.base import ExpertWeights, LoraTensors
from kt_ft.backends.grouped import GroupedTorchBackend
from kt_ft.backends.quant import FORMATS
from kt_ft.backends.quant_weights import QuantizedExperts

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=2048)
ap.add_argument("--threads", type=int, default=torch.get_num_threads())
ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
args = ap.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)
E, H, I, R, T, K = 128, 2048, 768, 8, args.tokens, 8
dt = torch.float32 if args.dtype == "fp32" else torch.bfloat16
gate_up = (torch.randn(E, 2 * I, H) * 0.02).to(dt)
down = (torch.randn(E, H, I) * 0.02).to(dt)


def quantized(w: torch.Tensor, fmt: str) -> QuantizedExperts:
    f = FORMATS[fmt]
    parts = [f.quantize(w[e]) for e in range(w.shape[0])]
    return QuantizedExperts(
        f, [{k: torch.stack([p[k] for p in parts]) for k in parts[0]}], [w.shape[1]], w.shape[2], dt
    )


shapes = [(E, R, H), (E, I, R), (E, R, H), (E, I, R), (E, R, I), (E, H, R)]
lora = LoraTensors(*(torch.randn(*s) * 0.01 for s in shapes))
x, w = torch.randn(T, H), torch.rand(T, K)
ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
times = {}
for name in ("dense", "fp8", "int8"):
    base = (
        ExpertWeights(gate_up, down)
        if name == "dense"
        else ExpertWeights(quantized(gate_up, name), quantized(down, name))
    )
    backend = GroupedTorchBackend()
    for _ in range(3):
        t0 = time.perf_counter()
        out, ctx = backend.forward(x, ids, w, base, lora, 2.0, True)
        backend.backward(ctx, torch.randn_like(out))
        times[name] = time.perf_counter() - t0
    print(f"{name:>6} {times[name] * 1e3:8.0f} ms  {times['dense'] / times[name]:.2f}x dense's rate")
