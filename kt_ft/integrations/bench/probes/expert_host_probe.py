"""Host time of one MoE layer's routed experts a pass, the way LLaMA-Factory runs them: kt-ft's
all-resident ``KTExperts`` (CUDA graphs replayed, expert LoRA trained) against transformers' own
``grouped_mm`` experts (what HF + PEFT runs: frozen, no expert LoRA), under reentrant gradient
checkpointing (a forward without grad, then the recompute and the backward).

A step that is bound by the host (the e2e bench's ``host main`` column and its threads' CPU time)
runs at the speed of these calls' Python, dispatch and launches, not of their kernels. Each pass
is timed on the host alone: the GPU is drained before it (so no launch waits for queue room), and
the timer stops when the call returns (the forward) or when the autograd engine is done queueing
(the backward, recompute included). Then one system's calls under a CPU-only profiler (no CUPTI:
the operator times are the host's), by self CPU time. A diagnostic: the e2e bench is the measure.

    python -m kt_ft.integrations.bench.probes.expert_host_probe [PRESET] [TOKENS] [REPEAT]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from kt_ft.backends.grouped import GroupedTorchBackend
from kt_ft.integrations.bench.models import MODEL_CONFIGS
from kt_ft.runtime.experts import KTExperts

RANK = 8


def hf_experts(preset: str, dev, dt):
    """transformers' Qwen3-MoE experts module of the preset's shape (grouped_mm), frozen, and (H, E, k)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = MODEL_CONFIGS[preset][1]
    experts = cfg.get("num_experts", cfg.get("n_routed_experts"))
    hf_cfg = Qwen3MoeConfig(
        hidden_size=cfg["hidden_size"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        num_experts=experts,
        num_experts_per_tok=cfg["num_experts_per_tok"],
    )
    hf_cfg._experts_implementation = "grouped_mm"
    m = Qwen3MoeExperts(hf_cfg).to(dev, dt)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    m.requires_grad_(False)
    return m, cfg["hidden_size"], experts, cfg["num_experts_per_tok"]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_passes(layer, x, ids, w, repeat: int) -> tuple[list[float], list[float]]:
    """Host ms of each forward without grad and of each backward (recompute + backward) of
    ``layer(x, ids, w)`` under reentrant checkpointing, ``repeat`` times after 5 warm-up passes
    (kt-ft captures its graphs in them)."""
    grad = torch.randn_like(x)
    fwd, bwd = [], []
    for i in range(repeat + 5):
        _sync()
        t0 = time.perf_counter()
        out = checkpoint(layer, x, ids, w, use_reentrant=True)
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        out.backward(grad)
        t3 = time.perf_counter()
        if i >= 5:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t3 - t2) * 1e3)
    _sync()
    return fwd, bwd


def host_ops(layer, x, ids, w, rows: int = 25) -> str:
    grad = torch.randn_like(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            checkpoint(layer, x, ids, w, use_reentrant=True).backward(grad)
            _sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    preset = argv[0] if len(argv) > 0 else "qwen3-30b-a3b"
    T = int(argv[1]) if len(argv) > 1 else 2048
    repeat = int(argv[2]) if len(argv) > 2 else 30
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (the CPU: a dry run)
    dt = torch.bfloat16
    hf, H, E, k = hf_experts(preset, dev, dt)
    x = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, device=dev), -1).to(dt).requires_grad_()
    # kt-ft's module around the same (CPU-held) weights, every expert resident, its LoRA on the GPU
    hf_cpu, _, _, _ = hf_experts(preset, torch.device("cpu"), dt)
    with torch.no_grad():
        hf_cpu.gate_up_proj.copy_(hf.gate_up_proj)
        hf_cpu.down_proj.copy_(hf.down_proj)
    kt = KTExperts(
        hf_cpu,
        layer_idx=0,
        rank=RANK,
        scaling=2.0,
        backend=GroupedTorchBackend(),
        chunk_size=4096,
        threads=None,
        resident_ids=tuple(range(E)),
        resident_device=dev,
        lora_device=dev,
    ).train()
    print(f"{preset} experts: {E} x [{H}], top-{k}, {T} tokens; host ms a pass, median (min-max) of {repeat}")
    systems = (
        ("transformers grouped_mm (HF+PEFT)", hf, "1"),
        ("kt-ft all resident, eager", kt, "0"),
        ("kt-ft all resident, CUDA graphs", kt, "1"),
    )
    for name, layer, graphs_on in systems:
        os.environ["KT_FT_CUDA_GRAPHS"] = graphs_on
        fwd, bwd = timed_passes(layer, x, ids, w, repeat)
        print(
            f"{name:<36} forward {statistics.median(fwd):6.3f} ({min(fwd):.3f}-{max(fwd):.3f})  "
            f"recompute+backward {statistics.median(bwd):6.3f} ({min(bwd):.3f}-{max(bwd):.3f})  "
            f"layer {statistics.median(fwd) + statistics.median(bwd):6.3f}"
        )
    graphs = kt.device_experts.graphs
    print(f"kt-ft graphs: {graphs.captures} captured, {graphs.replays} replays, off: {graphs.off}")
    for name, layer in (("transformers grouped_mm", hf), ("kt-ft", kt)):
        print(f"\n## {name}: 5 checkpointed passes, CPU-only profiler, by self CPU time\n")
        print(host_ops(layer, x, ids, w))


if __name__ == "__main__":
    main()
