"""Host and GPU time of one MoE layer's passes, HF + PEFT against kt-ft with every expert resident,
at DeepSeek-V2-Lite's shapes (2,048 tokens), kt-ft with and without its CUDA graphs.

python3 scripts/graph_probe.py [--tokens 2048] [--reps 20]

Host time: the wall time of queuing the calls while the GPU is held busy (``torch.cuda._sleep``),
so the host never waits for it; GPU time: CUDA events around the same calls, which then run back
to back once the sleep ends.
"""

import argparse
import os
import tempfile
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from kt_ft import KTConfig, apply
from kt_ft.bench.models import MODEL_CONFIGS

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=2048)
ap.add_argument("--reps", type=int, default=20)
a = ap.parse_args()
CUDA = torch.cuda.is_available()
dev = torch.device("cuda" if CUDA else "cpu")  # the CPU: a smoke run of the script only
fam, cfg = MODEL_CONFIGS["deepseek-v2-lite"]
cfg = {**cfg, "num_hidden_layers": 3, "vocab_size": 1024}


def model(kt: bool):
    config = AutoConfig.for_model(fam, **cfg)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    if kt:
        rule = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        rule.write(
            "- match: {class: DeepseekV2Experts}\n  replace: {device: cpu, gpu_experts: 64}\n"
            "- default: {device: cuda}\n"
        )
        rule.close()
        apply(m, KTConfig(rule=rule.name, rank=8, alpha=16, seed=0))
    m.to(dev).train()
    return m


def timed(fn, reps):
    for _ in range(3):
        fn()
    if not CUDA:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e3 * (time.perf_counter() - t0) / reps, float("nan")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU spin: the host queues everything meanwhile
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps
    e1.record()
    torch.cuda.synchronize()
    return 1e3 * host, e0.elapsed_time(e1) / reps


def passes(mlp, experts, tag):
    torch.manual_seed(1)
    x = torch.randn(1, a.tokens, cfg["hidden_size"], device=dev, dtype=torch.bfloat16)
    gy = torch.randn_like(x)

    def fwd():
        with torch.no_grad():
            mlp(x)

    def fwd_bwd():
        xx = x.detach().requires_grad_()
        y = mlp(xx)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(gy)

    for name, fn in (("fwd no-grad", fwd), ("fwd+bwd", fwd_bwd)):
        h, g = timed(fn, a.reps)
        print(f"{tag} MoE block {name}: host {h:.2f} ms, GPU {g:.2f} ms")
    # the experts alone, as the block calls them
    top = torch.randint(0, 64, (a.tokens, 6), device=dev)
    w = torch.rand(a.tokens, 6, device=dev, dtype=torch.bfloat16)
    xs = x[0]

    def e_fwd():
        with torch.no_grad():
            experts(xs, top, w)

    def e_fwd_bwd():
        xx = xs.detach().requires_grad_()
        experts(xx, top, w).backward(gy[0])

    for name, fn in (("fwd no-grad", e_fwd), ("fwd+bwd", e_fwd_bwd)):
        h, g = timed(fn, a.reps)
        print(f"{tag} experts {name}: host {h:.2f} ms, GPU {g:.2f} ms")


for system in ("HF+PEFT", "kt-ft eager", "kt-ft graphs"):
    # kt-ft's CUDA graphs of resident layers (kt_ft/moe/graphed.py) off, then on
    os.environ["KT_FT_CUDA_GRAPHS"] = "0" if system == "kt-ft eager" else "1"
    m = model(system != "HF+PEFT")
    layer = m.base_model.model.model.layers[1].mlp
    passes(layer, layer.experts, system)
    if system == "kt-ft graphs":
        g = layer.experts.device_experts.graphs
        print(f"{system}: {g.captures} graphs captured, {g.replays} replays, off: {g.off}")
    del m, layer
    if CUDA:
        torch.cuda.empty_cache()
