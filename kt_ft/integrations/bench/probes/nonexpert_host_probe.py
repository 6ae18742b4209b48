"""Host time of a training step's non-expert work, PEFT/transformers as shipped against kt-ft's
fused LoRA linears (kt_ft/backends/lora_linear.py), RMSNorm (kt_ft/backends/rms_norm.py) and rotary
embedding (kt_ft/backends/rotary.py).

A model of a bench preset's config (attention, norms, PEFT LoRA r 8 on every linear layer; for
Qwen3-30B-A3B the attention's four) with tiny experts, run at few tokens so the GPU's work is small and the wall time of a step is the
host's: forward and backward under bf16 autocast, gradient checkpointing per layer (reentrant,
as LLaMA-Factory runs it), the GPU drained once every ``--iters`` steps. Prints ms a step and a
layer for each variant, the variants interleaved over ``--rounds``.

    python -m kt_ft.integrations.bench.probes.nonexpert_host_probe [--preset qwen3-30b-a3b] [--layers 4] [--tokens 64]
        [--iters 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from kt_ft.backends.lora_linear import install_fused_lora
from kt_ft.backends.rms_norm import install_fused_rms_norm
from kt_ft.backends.rotary import install_fused_rotary, uninstall_fused_rotary
from kt_ft.integrations.bench.models import MODEL_CONFIGS


def _model(preset: str, layers: int, device: str):
    """The preset's real config (kt_ft/integrations/bench/models.py) at ``layers`` layers, with 8 experts of 64
    columns and a 1,024-token vocabulary: the non-expert work at its real shapes."""
    import peft
    import transformers

    model_type, real = MODEL_CONFIGS[preset]
    cfg = {**real, "num_hidden_layers": layers, "vocab_size": 1024, "moe_intermediate_size": 64}
    cfg.update({key: 8 for key in ("num_experts", "n_routed_experts") if key in real})
    cfg["num_experts_per_tok"] = 2
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    # every linear layer but lm_head (LLaMA-Factory's `lora_target: all`): for Qwen3-MoE q, k, v, o
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # LLaMA-Factory's fp32 LoRA parameters under bf16 autocast
    model.train()
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="qwen3-30b-a3b or deepseek-v2-lite")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = _model(args.preset, args.layers, device)
    # name -> (model, rotary fused): the rotary function is a module global, installed around each use
    variants = {"as shipped": (base, False)}
    variants["fused LoRA"] = (copy.deepcopy(base), False)
    install_fused_lora(variants["fused LoRA"][0])
    variants["fused norm"] = (copy.deepcopy(base), False)
    install_fused_rms_norm(variants["fused norm"][0])
    variants["fused rotary"] = (base, True)
    variants["all three"] = (copy.deepcopy(base), True)
    install_fused_lora(variants["all three"][0])
    install_fused_rms_norm(variants["all three"][0])
    ids = torch.randint(0, 1024, (1, args.tokens), device=device)

    def step(model):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def use(name):
        model, rotary = variants[name]
        uninstall_fused_rotary()
        if rotary:
            install_fused_rotary(model)
        return model

    losses = {name: step(use(name)).item() for name in variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            model = use(name)
            for _ in range(3):
                step(model)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(model)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / args.iters * 1e3)
    ref = statistics.median(times["as shipped"])
    print(
        f"{args.preset}, {device}, {args.layers} layers, {args.tokens} tokens, median of {args.rounds} rounds of "
        f"{args.iters} steps"
    )
    print("| variant | ms a step | ms a layer | x as shipped | first loss |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {med / args.layers:.3f} | {med / ref:.3f} | {losses[name]:.6f} |")


if __name__ == "__main__":
    main()
