"""The tiny model and training loops of the GPU-resident expert tests (tests/test_resident.py) that
the streamed, beside, placement, graphed and host-copy tests share: a qwen3_moe (or other family)
PEFT model with its routed experts replaced under a rule, batches, AdamW and the loops."""

from __future__ import annotations

import torch

from helpers.parity import ATTN
from helpers.tiny_models import tiny_model
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.patch import replace_routed_experts

# LoRA rank and alpha of ``build``'s models (attention and experts)
RANK, ALPHA = 4, 8
# 3 of the 8 experts resident on every layer, explicit ids [1, 6] on layer 1
GPU_RULE = (
    "- match: {class: Qwen3MoeExperts}\n"
    "  replace:\n"
    "    device: cpu\n"
    "    backend: torch\n"
    "    gpu_experts: [{layers: 1, ids: [1, 6]}, {count: 3}]\n"
    "- default: {device: cuda}\n"
)


def build(rule_path, family="qwen3_moe", backend="torch", chunk_size=4096, seed=0, **model_kw):
    """A tiny fp32 PEFT model (LoRA on attention) with its routed experts replaced under ``rule_path``;
    the same seed gives the same base weights and LoRA init whatever the rule. ``model_kw``: config
    overrides (e.g. num_hidden_layers). Returns the PEFT model (attention lora_B N(0, 0.02^2), expert
    lora_B N(0, 0.05^2), both seeded)."""
    from peft import LoraConfig, get_peft_model

    fam = FAMILIES[family]
    model = get_peft_model(
        tiny_model(family, seed=seed, **model_kw),
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTN, lora_dropout=0.0),
    )
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 7)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    plan = make_plan(model, load_rules(rule_path), fam, backend, 2)
    replace_routed_experts(model, plan, RANK, ALPHA / RANK, chunk_size, seed=seed + 1)
    with torch.no_grad():  # non-zero B: the expert LoRA contributes (and trains A) from step 0
        gen = torch.Generator().manual_seed(seed + 9)
        for m in model.modules():
            if isinstance(m, KTExperts):
                for n in ("gate_b", "up_b", "down_b"):
                    getattr(m, n).copy_(torch.randn(getattr(m, n).shape, generator=gen) * 0.05)
    return model


def adamw(model) -> torch.optim.AdamW:
    """A fused AdamW (lr 1e-2, eps 1e-3) over ``model``'s trainable parameters.

    Eps 1e-3: with the default 1e-8, m/(sqrt(v)+eps) turns a 1e-7 difference in a
    near-zero gradient entry (two summation orders, or another CPU's thread count) into an update
    difference of up to lr; an eps above such entries damps them, while entries with real gradients
    (1e-3 and up) still take AdamW-sized steps. The 16-thread GPU machine's CPU went past the 1e-4
    bound with the default eps. Fused: transformers' default optimizer (``adamw_torch_fused``), which
    updates the parameters without bumping their version counters -- a cache of the LoRA keyed on
    them alone (a bf16 cast, a device copy, a host mirror) went stale after step 1 and these tests,
    then on the per-tensor AdamW, did not see it."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, fused=True)


def train(model, batches, steps, gc, device="cpu", reentrant=True) -> list[float]:
    """``steps`` steps of ``adamw`` on ``batches`` in turn (token ids [B, S], their own labels, moved to
    ``device``), with gradient checkpointing when ``gc`` (``reentrant``: use_reentrant); returns the
    loss of each step (Python floats)."""
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
    model.train()
    opt = adamw(model)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def first_grads(model, gc) -> dict[str, torch.Tensor | None]:
    """Gradients of every trainable tensor after one forward/backward on the first of ``batches()``
    (reentrant checkpointing when ``gc``): parameter name -> a CPU copy of its gradient (the
    parameter's shape and dtype), None for one that got none."""
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
    model.train()
    ids = batches()[0]
    model(input_ids=ids, labels=ids).loss.backward()
    return {
        # on the CPU: with a GPU present the rule's ``default: {device: cuda}`` homes the expert LoRA there
        n: None if p.grad is None else p.grad.cpu().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def call_spy(monkeypatch, calls: list[str]):
    """Returns ``spy(obj, name, tag)``: from then on each call of ``obj.name`` appends ``tag`` to
    ``calls`` (through ``monkeypatch``, so undone after the test)."""

    def spy(obj, name, tag):
        orig = getattr(obj, name)

        def wrapped(*a, **k):
            calls.append(tag)
            return orig(*a, **k)

        monkeypatch.setattr(obj, name, wrapped)

    return spy


def kt_layers(model) -> list[KTExperts]:
    """The model's KTExperts modules, in module order (one per MoE layer)."""
    return [m for m in model.modules() if isinstance(m, KTExperts)]


def batches() -> list[torch.Tensor]:
    """Three batches of token ids, each [2, 12] int64 in [1, 97), the same every call (seed 5)."""
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(1, 97, (2, 12), generator=gen) for _ in range(3)]


def train_keep(model, data, start, stop, opt_state) -> list[float]:
    """Steps ``start`` .. ``stop - 1`` of ``adamw`` on ``data`` (token ids [B, S], step i on
    ``data[i % len(data)]``), the optimizer state carried in ``opt_state["s"]`` from call to call (read
    when present, written after); returns the loss of each step (Python floats)."""
    model.train()
    opt = adamw(model)
    if opt_state:
        opt.load_state_dict(opt_state["s"])
    losses = []
    for step in range(start, stop):
        ids = data[step % len(data)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt_state["s"] = opt.state_dict()
    return losses
