"""The chunked causal-LM loss (kt_ft/backends/lm_loss.py) against transformers' own: the function on
fresh random inputs against F.cross_entropy of the full logits (fp32: loss rel 1e-6, gradient
1e-6 of its largest entry; several chunks forced), and whole models (kt_ft.apply on a PEFT model)
against the same model without it: loss and every gradient (fp32: rel 1e-5 / 1e-5 of the largest
entry), with the MoE auxiliary loss, with num_items_in_batch, and eval / no-label calls unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.lm_loss import apply_both
from helpers.tiny_models import tiny_model
from peft import LoraConfig, get_peft_model

import kt_ft
from kt_ft.backends import lm_loss


def _seed() -> int:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    return seed


@pytest.mark.parametrize("divisor", ["mean", "items"])
def test_chunked_loss_is_the_cross_entropy_of_the_full_logits(monkeypatch, divisor):
    gen = torch.Generator().manual_seed(_seed())
    n, h, v = 37, 16, 50
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 8 * v * 4)  # 8 rows a chunk: 5 chunks, the last short
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).float().requires_grad_(True)
    weight, bias = torch.randn(v, h, generator=gen), torch.randn(v, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[torch.randperm(n, generator=gen)[:9]] = -100
    items = torch.tensor(40) if divisor == "items" else None  # e.g. counted over the whole batch
    want = F.cross_entropy(
        F.linear(hidden, weight, bias), targets, reduction="sum" if items is not None else "mean"
    )
    if items is not None:
        want = want / items
    grad = torch.rand((), generator=gen) + 0.5  # the trainer's 1 / accumulation steps, say
    (want_h,) = torch.autograd.grad(want * grad, hidden)
    div = items if items is not None else (targets != -100).sum()
    got = lm_loss.chunked_lm_loss(hidden, weight, bias, targets, div)
    (got_h,) = torch.autograd.grad(got * grad, hidden)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=1e-6 * want_h.abs().max().item())


@pytest.mark.parametrize("lacks_bf16", [True, False])
def test_bf16_loss_on_a_cpu_without_bf16_is_computed_in_fp32(monkeypatch, lacks_bf16):
    """KT_FT_CPU_UPCAST: on a CPU without bf16 arithmetic (forced here), the bf16 lm_head's products run
    in fp32, the weight upcast a block of rows at a time (3 blocks, the last short): within fp32
    rounding of the float64 loss of the same bf16 values; with native bf16, torch's bf16 products
    (within bf16's rounding)."""
    from kt_ft.backends import cpu_fp32

    monkeypatch.setattr(cpu_fp32, "_cpu_lacks_bf16", lambda: lacks_bf16)
    monkeypatch.setattr(cpu_fp32, "BLOCK_BYTES", 20 * 16 * 4)  # 20 rows of the [50, 16] weight a block
    gen = torch.Generator().manual_seed(_seed())
    n, h, v = 29, 16, 50
    hidden = torch.randn(n, h, generator=gen).bfloat16().requires_grad_(True)
    weight = torch.randn(v, h, generator=gen).bfloat16()
    targets = torch.randint(0, v, (n,), generator=gen)
    h64 = hidden.detach().double().requires_grad_(True)
    want = F.cross_entropy(F.linear(h64, weight.double()), targets, reduction="sum") / n
    (want_h,) = torch.autograd.grad(want, h64)
    got = lm_loss.chunked_lm_loss(hidden, weight, None, targets, n)
    (got_h,) = torch.autograd.grad(got, hidden)
    assert cpu_fp32.upcasts(weight.device, weight.dtype) == lacks_bf16
    tol = 1e-5 if lacks_bf16 else 2e-2  # fp32 sums of bf16 values, or bf16 logits
    assert abs(got.item() - want.item()) <= tol * abs(want.item())
    # the gradient is returned in bf16 either way: its rounding (2^-8) bounds both
    assert (got_h.double() - want_h).abs().max() <= 2**-7 * want_h.abs().max()


def _pair(family="qwen3_moe", **overrides):
    """A PEFT model with kt-ft's experts and the chunked loss, and its twin with the model's own loss."""
    base = get_peft_model(
        tiny_model(family, **overrides), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    twin = copy.deepcopy(base)
    cfg = dict(rule=f"{family}-torch" if family == "qwen3_moe" else None, rank=4, alpha=8, threads=1, seed=1)
    apply_both(base, twin, kt_ft.KTConfig(**cfg))
    return base, twin


def _loss_and_grads(model, ids, labels, **kw):
    model.train()
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


@pytest.mark.parametrize("aux", [False, True])
def test_a_model_trains_with_the_loss_of_its_own_forward(aux):
    gen = torch.Generator().manual_seed(_seed())
    base, twin = _pair(**({"output_router_logits": True, "router_aux_loss_coef": 0.05} if aux else {}))
    ids = torch.randint(1, 97, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    for kw in ({}, {"num_items_in_batch": torch.tensor(30)}):
        got, g1 = _loss_and_grads(base, ids, labels, **kw)
        want, g2 = _loss_and_grads(twin, ids, labels, **kw)
        assert got.logits is None and want.logits is not None
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
        assert (
            g1.keys() == g2.keys()
            and any("lora_A" in n for n in g1)
            and any("experts.gate_a" in n for n in g1)
        )
        for n, g in g2.items():
            torch.testing.assert_close(g1[n], g, rtol=0, atol=1e-5 * g.abs().max().item() + 1e-12, msg=n)
        if aux:
            assert got.aux_loss is not None
            torch.testing.assert_close(got.aux_loss, want.aux_loss)


def test_eval_and_unlabelled_calls_keep_the_logits():
    gen = torch.Generator().manual_seed(_seed())
    base, twin = _pair()
    ids = torch.randint(1, 97, (2, 12), generator=gen)
    base.eval(), twin.eval()
    with torch.no_grad():
        a, b = base(input_ids=ids, labels=ids), twin(input_ids=ids, labels=ids)
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.loss, b.loss)
    base.train(), twin.train()
    torch.testing.assert_close(base(input_ids=ids).logits, twin(input_ids=ids).logits)


def test_models_that_transform_their_logits_keep_their_own_loss():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3_moe")
    assert lm_loss.supported(cfg)
    cfg.final_logit_softcapping = 30.0
    assert not lm_loss.supported(cfg)
    model = tiny_model()
    model.config.final_logit_softcapping = 30.0
    assert "soft-caps" in lm_loss.install(model)


def test_the_estimate_counts_the_chunked_loss(monkeypatch, capsys):
    """``kt-ft rules plan``'s GPU activations: transformers' 14 bytes a logit, or the chunk's."""
    from transformers import AutoConfig

    from kt_ft.formats.skeleton import meta_model
    from kt_ft.plan.builtin import resolve_rule_path
    from kt_ft.plan.families import FAMILIES
    from kt_ft.plan.loader import load_rules
    from kt_ft.plan.placement import make_plan
    from kt_ft.plan.report import LOSS_BYTES_PER_LOGIT, TrainSizes, estimate

    config = AutoConfig.for_model("qwen3_moe", **{**FAMILIES["qwen3_moe"].demo_config, "vocab_size": 151936})
    model = meta_model(config, torch.bfloat16)
    plan = make_plan(
        model,
        load_rules(resolve_rule_path("qwen3_moe")),
        FAMILIES["qwen3_moe"],
        "torch",
        1,
        planning_only=True,
    )
    sizes = TrainSizes(2048, 1, 8)
    chunked = estimate(model, plan, torch.bfloat16, sizes)["devices"]["cuda:0"]["activation_bytes"]
    monkeypatch.setenv("KT_FT_FUSIONS", "lora,norm,rope")  # all but the chunked loss
    full = estimate(model, plan, torch.bfloat16, sizes)["devices"]["cuda:0"]["activation_bytes"]
    h = config.hidden_size
    assert full - chunked == LOSS_BYTES_PER_LOGIT * 2048 * 151936 - lm_loss.loss_bytes(2048, 151936, h)
    assert full - chunked > 3.5 * 2**30
