"""The fused LoRA linear (kt_ft/backends/lora_linear.py) against PEFT's own forward and backward.

PEFT is the independent reference: each test builds a PEFT model, copies it, gives the copy the
fused forward and compares outputs and every gradient on fresh random inputs (seed printed).
Tolerances: fp32 products 1e-5 relative to the largest value; bf16 autocast 2e-2 (PEFT rounds the
LoRA term to bf16 before its add, the fused node adds it in the product's fp32 accumulator).
"""

import copy

import pytest
import torch
from helpers.compare import assert_close as _close
from helpers.compare import assert_trains_alike
from helpers.compare import fresh_seed as _seed

peft = pytest.importorskip("peft")

from kt_ft.backends.lora_linear import install_fused_lora  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self, d_in=24, d_hid=40, d_out=16, bias=False):
        super().__init__()
        self.up = torch.nn.Linear(d_in, d_hid, bias=bias)
        self.down = torch.nn.Linear(d_hid, d_out, bias=bias)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def _pair(*, dtype=torch.float32, lora_dtype=torch.float32, bias=False, dropout=0.0, gen=None):
    """(PEFT model, its copy with the fused forward): B drawn non-zero so the LoRA term counts."""
    base = _Net(bias=bias).to(dtype)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], lora_dropout=dropout)
    ref = peft.get_peft_model(base, cfg)
    for name, p in ref.named_parameters():
        if "lora_" in name:
            p.data = (torch.randn(p.shape, generator=gen) * 0.2).to(lora_dtype)
    fused = copy.deepcopy(ref)
    return ref, fused


def _run(model, x, autocast=None):
    x = x.clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
        y = model(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return y.detach().float(), x.grad.float(), grads


@pytest.mark.parametrize("bias", [False, True])
def test_fused_lora_matches_peft_in_fp32(bias):
    gen = torch.Generator().manual_seed(_seed())
    ref, fused = _pair(bias=bias, gen=gen)
    assert install_fused_lora(fused)[0] == 2
    x = torch.randn(3, 7, 24, generator=gen)
    y0, dx0, g0 = _run(ref, x)
    y1, dx1, g1 = _run(fused, x)
    _close(y1, y0, 1e-5, "output")
    _close(dx1, dx0, 1e-5, "input gradient")
    assert g0.keys() == g1.keys() and len(g0) == 4
    for name in g0:
        _close(g1[name], g0[name], 1e-5, name)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fused_lora_matches_peft_under_bf16_autocast(device):
    """LLaMA-Factory's bf16 recipe: bf16 base weights, fp32 LoRA parameters, autocast to bf16."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(_seed())
    ref, fused = _pair(dtype=torch.bfloat16, lora_dtype=torch.float32, gen=gen)
    ref, fused = ref.to(device), fused.to(device)
    install_fused_lora(fused)
    x = torch.randn(2, 33, 24, generator=gen).to(device=device, dtype=torch.bfloat16)
    y0, dx0, g0 = _run(ref, x, autocast=torch.bfloat16)
    y1, dx1, g1 = _run(fused, x, autocast=torch.bfloat16)
    _close(y1, y0, 2e-2, "output")
    _close(dx1, dx0, 2e-2, "input gradient")
    for name in g0:
        assert g1[name].dtype == torch.float32, name  # accumulated into the fp32 parameters' own dtype
        _close(g1[name], g0[name], 2e-2, name)


def test_calls_fused_lora_cannot_take_go_through_peft(monkeypatch):
    """Merged adapters, disabled adapters and LoRA dropout keep PEFT's forward (exact)."""
    gen = torch.Generator().manual_seed(_seed())
    ref, fused = _pair(gen=gen)
    install_fused_lora(fused)
    x = torch.randn(5, 24, generator=gen)
    with ref.disable_adapter(), fused.disable_adapter(), torch.no_grad():
        assert torch.equal(fused(x), ref(x))
    ref.merge_adapter()
    fused.merge_adapter()
    with torch.no_grad():
        assert torch.equal(fused(x), ref(x))
    ref.unmerge_adapter()
    fused.unmerge_adapter()
    with torch.no_grad():
        _close(fused(x), ref(x), 1e-5, "after unmerge")

    _, dropped = _pair(dropout=0.1, gen=gen)
    fused_count, skipped = install_fused_lora(dropped)
    assert fused_count == 0 and skipped == {"LoRA dropout": 2}

    monkeypatch.setenv("KT_FT_FUSIONS", "norm,rope,loss")  # all but lora
    _, off = _pair(gen=gen)
    assert install_fused_lora(off)[0] == 0
    assert not any(hasattr(m, "_kt_ft_adapter") for m in off.modules())


def test_fused_lora_trains_a_tiny_moe_like_peft():
    """A whole tiny Qwen3-MoE under PEFT (every linear), loss and every LoRA gradient."""
    pytest.importorskip("transformers")
    from helpers.tiny_models import tiny_model

    gen = torch.Generator().manual_seed(_seed())
    base = tiny_model("qwen3_moe", seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    ref = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in ref.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.1
    fused = copy.deepcopy(ref)
    count, _ = install_fused_lora(fused)
    assert count >= 8  # q, k, v, o of both layers at least
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=gen)
    assert_trains_alike(ref, fused, ids)
