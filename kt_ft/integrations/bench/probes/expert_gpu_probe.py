"""Where one MoE layer's expert work spends GPU time: kt-ft's fused grouped experts (the body its
CUDA graphs replay: ``fused_forward`` / ``fused_backward``, expert LoRA trained) against
transformers' own ``grouped_mm`` experts (what HF + PEFT runs: no expert LoRA, frozen weights, so
its backward is the input gradient only), at a preset's layer shape with random routing.

Per system: GPU busy time (kernel durations summed, torch.profiler) of the forward and of the
backward, and a step's share under LLaMA-Factory's reentrant checkpointing (forward twice, backward
once); then each system's kernels by GPU time. A diagnostic: the e2e bench is the measurement.

    python -m kt_ft.integrations.bench.probes.expert_gpu_probe [PRESET] [TOKENS]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kt_ft.backends import grouped_device as gdev
from kt_ft.backends.base import ExpertWeights
from kt_ft.backends.grouped_device import Groups, combine_all, fused_backward, fused_forward, stack_lora
from kt_ft.backends.grouped_wide import WideExperts
from kt_ft.integrations.bench.models import MODEL_CONFIGS

RANK = 8


def shape(preset: str) -> tuple[int, int, int, int]:
    """(H, I, E, k) of the preset's routed experts."""
    cfg = MODEL_CONFIGS[preset][1]
    experts = cfg.get("num_experts", cfg.get("n_routed_experts"))
    return cfg["hidden_size"], cfg["moe_intermediate_size"], experts, cfg["num_experts_per_tok"]


def kernels(fn, repeat: int = 3) -> tuple[float, list[tuple[str, int, float]]]:
    """(GPU-busy ms per call, [(kernel, calls per call, ms per call)]) of ``fn`` over ``repeat`` calls."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    rows = [
        (e.key, e.count // repeat, e.self_device_time_total / 1e3 / repeat)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[2])
    return sum(r[2] for r in rows), rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    preset = argv[0] if len(argv) > 0 else "qwen3-30b-a3b"
    T = int(argv[1]) if len(argv) > 1 else 2048
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, inter, E, k = shape(preset)
    print(
        f"{preset}: H {H}, I {inter}, {E} experts top-{k}, {T} tokens, LoRA r {RANK}, {torch.cuda.get_device_name()}"
    )
    x = torch.randn(T, H, device=dev, dtype=dt)
    logits = torch.randn(T, E, device=dev)
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(dt)
    gate_up = torch.randn(E, 2 * inter, H, device=dev, dtype=dt) * H**-0.5
    down = torch.randn(E, H, inter, device=dev, dtype=dt) * inter**-0.5
    base = ExpertWeights(gate_up, down)
    lora = tuple(
        torch.randn(*s, device=dev) * 0.01
        for s in (
            (E, RANK, H),
            (E, inter, RANK),
            (E, RANK, H),
            (E, inter, RANK),
            (E, RANK, inter),
            (E, H, RANK),
        )
    )
    cast = stack_lora(*lora, dt, base.spec)
    grad = torch.randn(T, H, device=dev, dtype=torch.float32)

    # the same weights in the wide layout (kt_ft/backends/grouped_wide.py: the LoRA beside them)
    wide = WideExperts.from_weights(gate_up, down, RANK, base.spec, dev)
    base_wide = ExpertWeights(wide.gate_up, wide.down, wide=wide)

    def kt_forward(b=base, out_dtype=None):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
        out, saved, meta = fused_forward(
            x, w, lora, b, 2.0, Groups(counts, flat.numel()), order, k, lambda *a: cast, out_dtype
        )
        return out.to(dt), saved, meta

    state = {}

    def kt_fwd():
        state["fwd"] = kt_forward()

    def kt_bwd():
        _, saved, meta = state["fwd"]
        fused_backward(grad, saved, meta, True, True)

    grad_bf16 = grad.to(dt)

    def kt_bwd_bf16():  # the same with the output's gradient in bf16: what its fp32 passes cost
        _, saved, meta = state["fwd"]
        fused_backward(grad_bf16, saved, meta, True, True)

    def kt_fwd_wide():  # what a run's all-resident layer does now: wide layout, output in bf16
        state["fwd"] = kt_forward(base_wide, dt)

    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=k)
    cfg._experts_implementation = "grouped_mm"
    hf = Qwen3MoeExperts(cfg).to(dev, dt)
    with torch.no_grad():
        hf.gate_up_proj.copy_(gate_up)
        hf.down_proj.copy_(down)
    hf.requires_grad_(False)
    xg = x.detach().requires_grad_()

    def hf_fwd_nograd():
        with torch.no_grad():
            hf(x, ids, w)

    def hf_fwd():
        state["hf"] = hf(xg, ids, w)

    def hf_bwd():
        state["hf"].backward(grad.to(dt))

    def both(f, b):
        def run():
            f()
            b()

        return run

    systems = {
        "kt-ft fused (expert LoRA)": (kt_fwd, both(kt_fwd, kt_bwd)),
        "kt-ft fused, bf16 output gradient": (kt_fwd, both(kt_fwd, kt_bwd_bf16)),
        "kt-ft fused, wide layout, bf16 output": (kt_fwd_wide, both(kt_fwd_wide, kt_bwd_bf16)),
        "transformers grouped_mm (HF+PEFT)": (hf_fwd_nograd, both(hf_fwd, hf_bwd)),
    }
    tables = {}
    for name, (fwd, fwd_bwd) in systems.items():
        f_ms, _ = kernels(fwd)
        fb_ms, rows = kernels(fwd_bwd)
        tables[name] = rows
        step = f_ms + fb_ms  # checkpointed: a forward without grad, then the recompute and the backward
        print(
            f"{name:<36} forward {f_ms:6.3f} ms  backward {fb_ms - f_ms:6.3f} ms  checkpointed layer {step:6.3f} ms"
        )
    # the scatter back to tokens: fp32 atomics (index_add_, what pairs split with the CPU op take)
    # against the gather + batched product of a call whose pairs are all on the GPU (combine_all)
    d = torch.randn(T * k, H, device=dev, dtype=dt)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = torch.div(order, k, rounding_mode="floor")
    ws = w.reshape(-1).index_select(0, order).float()

    def scatter():
        out = torch.zeros(T, H, device=dev)
        out.index_add_(0, tok, d * ws[:, None])

    for name, fn in (
        ("index_add_ (fp32 atomics)", scatter),
        ("gather + bmm", lambda: combine_all(d, w, order, torch.float32)),
    ):
        print(f"combine, {name:<28} {kernels(fn)[0]:6.3f} ms")
    # each grouped product of kt-ft's pass alone, at the layer's shapes and groups (N pairs sorted
    # by expert): what the expert LoRA's rank-sized products cost beside the base ones, and what
    # widening a base product by the LoRA A rows (one product for both) would cost instead
    n, r = T * k, RANK
    groups = Groups(torch.bincount(ids.reshape(-1), minlength=E), n)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dt)

    xs, pa, h, pd, gdd, dgu, ts, dpa = (
        rnd(n, H),
        rnd(n, 2 * r),
        rnd(n, inter),
        rnd(n, r),
        rnd(n, H),
        rnd(n, 2 * inter),
        rnd(n, r),
        rnd(n, 2 * r),
    )
    a_gu, b_gu, ad, bd = rnd(E, 2 * r, H), rnd(E, 2 * inter, 2 * r), rnd(E, r, inter), rnd(E, H, r)
    wide_gu, wide_d = rnd(E, 2 * inter + 2 * r, H), rnd(E, H + r, inter)
    # one buffer a projection holding the base block, the LoRA A rows below it and the (scaled)
    # LoRA B columns beside it: the forward reads [W; A] (rows), the backward [W | B] (columns)
    buf_gu, buf_d = rnd(E, 2 * inter + 2 * r, H + 2 * r), rnd(E, H + r, inter + r)
    t_ = gdev._t
    products = {
        "fwd gate_up base [N,H]x[H,2I]": lambda: gdev.grouped_mm(xs, t_(gate_up), groups),
        "fwd gate_up base + A rows [N,H]x[H,2I+2r]": lambda: gdev.grouped_mm(xs, t_(wide_gu), groups),
        "fwd LoRA A gate/up [N,H]x[H,2r]": lambda: gdev.grouped_mm(xs, t_(a_gu), groups),
        "fwd LoRA B gate/up [N,2r]x[2r,2I]": lambda: gdev.grouped_mm(pa, t_(b_gu), groups),
        "fwd down base [N,I]x[I,H]": lambda: gdev.grouped_mm(h, t_(down), groups),
        "fwd down base + A rows [N,I]x[I,H+r]": lambda: gdev.grouped_mm(h, t_(wide_d), groups),
        "fwd LoRA A down [N,I]x[I,r]": lambda: gdev.grouped_mm(h, t_(ad), groups),
        "fwd LoRA B down [N,r]x[r,H]": lambda: gdev.grouped_mm(pd, t_(bd), groups),
        "bwd dh base [N,H]x[H,I]": lambda: gdev.grouped_mm(gdd, down, groups),
        "bwd gd Bd [N,H]x[H,r]": lambda: gdev.grouped_mm(gdd, bd, groups),
        "bwd grad Bd (K-grouped)": lambda: gdev.grouped_mm_k(gdd.t(), pd, groups),
        "bwd grad Ad (K-grouped)": lambda: gdev.grouped_mm_k(ts.t(), h, groups),
        "bwd ts Ad [N,r]x[r,I]": lambda: gdev.grouped_mm(ts, ad, groups),
        "bwd grad B_gu (K-grouped)": lambda: gdev.grouped_mm_k(dgu.t(), pa, groups),
        "bwd dpa [N,2I]x[2I,2r]": lambda: gdev.grouped_mm(dgu, b_gu, groups),
        "bwd grad A_gu (K-grouped)": lambda: gdev.grouped_mm_k(dpa.t(), xs, groups),
        "bwd dx base [N,2I]x[2I,H]": lambda: gdev.grouped_mm(dgu, gate_up, groups),
        "bwd dpa A_gu [N,2r]x[2r,H]": lambda: gdev.grouped_mm(dpa, a_gu, groups),
        "buffer: fwd [W;A] gate_up view [N,H]x[H,2I+2r]": lambda: gdev.grouped_mm(
            xs, t_(buf_gu[:, :, :H]), groups
        ),
        "buffer: fwd [W;A] down view [N,I]x[I,H+r]": lambda: gdev.grouped_mm(
            h, t_(buf_d[:, :, :inter]), groups
        ),
        "buffer: bwd [W|B] down view [N,H]x[H,I+r]": lambda: gdev.grouped_mm(gdd, buf_d[:, :H], groups),
        "buffer: bwd [W|B] gate_up view [N,2I]x[2I,H+2r]": lambda: gdev.grouped_mm(
            dgu, buf_gu[:, : 2 * inter], groups
        ),
    }
    print("\nkt-ft's grouped products one at a time (GPU ms a call):")
    for name, fn in products.items():
        print(f"  {kernels(fn)[0]:7.3f}  {name}")
    for name, rows in tables.items():
        print(f"\n{name}: forward + backward, kernels by GPU time (ms a call, launches)")
        for key, count, ms in rows[:30]:
            print(f"  {ms:7.3f} {count:4d}  {key[:110]}")


if __name__ == "__main__":
    main()
