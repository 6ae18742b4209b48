"""Shared experts started beside the CPU op (kt_ft/runtime/beside.py), checked on the CPU.

The reordering must not change a number: the same modules run on the same data and are summed
in the same order, so a model with the overlap on trains like one with it off
(the block's own order: the model built without ``install_shared_beside``). Tolerance (fp32): losses rel 1e-6 per
step, every trainable tensor after 3 AdamW steps abs 1e-4. The forward is the same arithmetic;
the backward sums the two branches' gradients of the block input in another order where HF
computes the shared expert first (Qwen2-MoE, Qwen3.5-MoE: seen 1e-7 relative in the losses,
1.2e-5 in an expert-LoRA tensor after AdamW, whose m/sqrt(v) amplifies a 1e-7 difference in a
near-zero gradient entry; test_resident.py's bound for the same reason). DeepSeek-V2 was seen
bitwise equal. test_parity.py compares these families, overlap on, with HF's own blocks and a
pure-torch expert loop.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.parity import ATTN
from helpers.resident import batches, call_spy, first_grads, kt_layers, train
from helpers.tiny_models import tiny_model
from peft import LoraConfig, get_peft_model
from transformers import CONFIG_MAPPING

from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.runtime import beside as beside_mod
from kt_ft.runtime import patch as patch_mod
from kt_ft.runtime.patch import replace_routed_experts

RANK, ALPHA = 4, 8
SHARED_FAMILIES = ["qwen2_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "glm4_moe"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def build(family: str, overlap: bool, monkeypatch, seed: int = 0, rule=None):
    """Tiny PEFT model (LoRA on attention and on the shared experts / dense MLPs), routed experts
    replaced (``rule``: a rule file, default the family's); the same seed gives the same weights
    whatever ``overlap`` (False: the block's own order, no shared branch started beside the CPU op)."""
    fam = FAMILIES[family]
    if fam.demo_type not in CONFIG_MAPPING:
        pytest.skip(f"{family}: model type {fam.demo_type!r} is not in this transformers")
    model = get_peft_model(
        tiny_model(family, seed=seed),
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTN + MLP, lora_dropout=0.0),
    )
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 7)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    plan = make_plan(model, load_rules(rule or resolve_rule_path(fam.builtin_rule)), fam, "torch", 2)
    with monkeypatch.context() as m:
        if not overlap:
            m.setattr(patch_mod, "install_shared_beside", lambda block, experts, where: None)
        replace_routed_experts(model, plan, RANK, ALPHA / RANK, 4096, seed=seed + 1)
    return model


@pytest.mark.parametrize("gc", [False, True])
@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_overlap_trains_like_the_blocks_own_order(family, gc, monkeypatch):
    plain = build(family, False, monkeypatch)
    assert all(m.beside is None for m in kt_layers(plain))
    model = build(family, True, monkeypatch)
    layers = kt_layers(model)
    assert layers and all(m.beside is not None for m in layers)
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ref = train(plain, batches(), 3, gc)
    got = train(model, batches(), 3, gc)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-6, atol=0)
    want = dict(plain.named_parameters())
    shared_lora = 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, want[n], rtol=0, atol=1e-4, msg=n)
            if "shared_expert" in n and "lora_" in n:
                shared_lora += 1
                assert not torch.equal(p, init[n]), f"{n} did not train"
    # PEFT >= 0.21 drops gate/up/down_proj targets of some MoE families (README "Known traps"):
    # then the shared experts have no LoRA, and the branch still gets its input's gradient
    if "down_proj" in model.peft_config["default"].target_modules:
        assert shared_lora > 0
    # every forward of a MoE block (first pass and reentrant recompute) started the shared
    # branch beside its CPU op and the block took it: nothing computed twice
    calls = 3 * (2 if gc else 1)
    assert [(m.beside.started, m.beside.taken) for m in layers] == [(calls, calls)] * len(layers)


def test_overlap_with_every_expert_on_the_device(monkeypatch, tmp_path):
    """``stream: all``: no CPU op to overlap; the shared branch is not started beside (the block
    computes it in its own order, no warning), and the model trains as with the overlap off."""
    rule = tmp_path / "all.yaml"
    rule.write_text(
        "- match: {class: DeepseekV2Experts}\n  replace: {device: cpu, backend: torch, stream: all}\n"
    )
    plain = build("deepseek_v2", False, monkeypatch, rule=rule)
    model = build("deepseek_v2", True, monkeypatch, rule=rule)
    ref, got = train(plain, batches(), 3, gc=True), train(model, batches(), 3, gc=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-6, atol=0)
    layers = kt_layers(model)
    assert all(m.runner.forward_calls == 0 for m in layers)
    assert [(m.beside.started, m.beside.taken, m.beside._warned) for m in layers] == [(0, 0, False)] * len(
        layers
    )


@pytest.mark.parametrize("gc", [False, True])
@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_first_step_gradients_match(family, gc, monkeypatch):
    """Every trainable tensor gets its gradient (the first layer's input needs none: the shared
    LoRA must still get one) within 2e-6 of its largest entry (seen 3.7e-7; 0 for DeepSeek)."""
    grads = []
    for overlap in (False, True):
        grads.append(first_grads(build(family, overlap, monkeypatch), gc))
    ref, got = grads
    assert ref.keys() == got.keys()
    missing = [n for n, g in got.items() if g is None and ref[n] is not None]
    assert not missing, missing
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=0, atol=2e-6 * g.abs().max().item(), msg=n)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2"])
def test_shared_work_is_queued_before_the_cpu_op_blocks(family, monkeypatch):
    """Forward: CPU-op input copies started, shared branch queued, then the CPU op, per layer;
    backward: the shared branch's backward (which starts the CPU op's gradient copy first) right
    before that layer's CPU op backward."""
    model = build(family, True, monkeypatch)
    calls = []
    spy = call_spy(monkeypatch, calls)
    for i, layer in enumerate(kt_layers(model)):
        spy(layer.runner, "prefetch", f"prefetch inputs {i}")
        spy(layer.beside, "start", f"queue shared {i}")
        spy(layer.runner, "forward", f"cpu forward {i}")
        spy(layer.runner, "backward", f"cpu backward {i}")
    spy(beside_mod, "prefetch_grad_out", "shared backward")
    ids = batches()[0]
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    n = len(kt_layers(model))
    assert n >= 1
    forward = [c for c in calls if not c.startswith(("cpu backward", "shared backward"))]
    assert forward == [
        f"{t} {i}" for i in range(n) for t in ("prefetch inputs", "queue shared", "cpu forward")
    ]
    backward = calls[len(forward) :]
    assert backward == [t for i in reversed(range(n)) for t in ("shared backward", f"cpu backward {i}")]


def test_block_calling_shared_experts_with_another_input_falls_back(monkeypatch, caplog):
    model = build("deepseek_v3", True, monkeypatch)
    layer = kt_layers(model)[0]
    shared = layer.beside.block.shared_experts
    x = torch.randn(5, 64)
    other = torch.randn(1, 5, 64)
    with torch.no_grad():
        layer.beside.start(x)
        logger = logging.getLogger("kt_ft")
        monkeypatch.setattr(logger, "propagate", True)
        with caplog.at_level(logging.WARNING, logger="kt_ft"):
            got = shared(other)
        want = type(shared).forward(shared, other)
    assert torch.equal(got, want)
    assert "called with another input" in caplog.text
    with torch.no_grad():  # the same data, another view: taken, equal to computing it
        layer.beside.start(x)
        assert torch.equal(shared(x.view(1, 5, 64)), type(shared).forward(shared, x).view(1, 5, 64))
    assert layer.beside.taken == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on the GPU machine")
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_overlap_on_cuda_trains_like_the_blocks_own_order(family, monkeypatch):
    """On a GPU: same losses (rel 1e-5) with the overlap on and off, and the CPU op's backward
    finds its incoming gradient already copied (started by the shared branch's backward)."""
    from kt_ft.runtime.transfer import STAGING

    losses = []
    for overlap in (False, True):
        model = build(family, overlap, monkeypatch).to("cuda")
        hits = STAGING.prefetch_hits
        losses.append(train(model, batches(), 3, gc=True, device="cuda"))
        if overlap:
            assert STAGING.prefetch_hits - hits >= 3 * len(kt_layers(model)) * 2  # inputs + grad, per step
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=0)
