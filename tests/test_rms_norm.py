"""RMSNorm through torch's rms_norm (kt_ft/backends/rms_norm.py) against transformers' own forward.

Reference: the module's class forward on the same weights; fresh random inputs and weights
(seed printed). Tolerances: fp32 1e-5 relative to the largest value; bf16 one bf16 rounding step
(1e-2), the fp32 reductions' order being the only difference before the cast.
"""

import copy

import pytest
import torch
from helpers.compare import assert_close as _close
from helpers.compare import assert_trains_alike
from helpers.compare import fresh_seed as _seed

transformers = pytest.importorskip("transformers")

from kt_ft.backends.rms_norm import install_fused_rms_norm  # noqa: E402


def _tiny_qwen3_moe(seed: int = 0):
    from helpers.tiny_models import tiny_model

    return tiny_model("qwen3_moe", seed=seed)  # 2 layers, head_dim 16


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_the_modules_own_forward(dtype, tol, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(_seed())
    model = _tiny_qwen3_moe().to(device=device, dtype=dtype)
    norm = model.model.layers[0].self_attn.q_norm  # [..., heads, head_dim] input: the last dim only
    norm.weight.data = (torch.rand(norm.weight.shape, generator=gen) + 0.5).to(device=device, dtype=dtype)
    norm.weight.requires_grad_(True)
    fused = copy.deepcopy(norm)
    assert install_fused_rms_norm(fused) == 1
    x = (torch.randn(2, 5, 4, 16, generator=gen) * 3).to(device=device, dtype=dtype)
    outs = []
    for module in (norm, fused):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device=device)).sum().backward()
        outs.append((y.detach(), xi.grad, module.weight.grad))
    for (a, b), what in zip(zip(outs[1], outs[0]), ("output", "input gradient", "weight gradient")):
        assert a.dtype == b.dtype, what
        _close(a, b, tol, what)


def test_a_norm_that_normalises_otherwise_keeps_its_forward(monkeypatch):
    class ShiftedRMSNorm(torch.nn.Module):  # Gemma's form: x / rms(x) * (1 + weight)
        def __init__(self, hidden):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(hidden))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)

    shifted = torch.nn.Sequential(ShiftedRMSNorm(16), ShiftedRMSNorm(16))
    assert install_fused_rms_norm(shifted) == 0
    assert all("forward" not in m.__dict__ for m in shifted)

    model = _tiny_qwen3_moe()
    monkeypatch.setenv("KT_FT_FUSIONS", "lora,rope,loss")  # all but norm
    assert install_fused_rms_norm(model) == 0


def test_a_tiny_moe_trains_the_same_with_the_fused_norm():
    """Every RMSNorm of a tiny Qwen3-MoE (2 layers: 4 each, and the final one), loss and gradients."""
    gen = torch.Generator().manual_seed(_seed())
    ref = _tiny_qwen3_moe(seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    fused = copy.deepcopy(ref)
    assert install_fused_rms_norm(fused) == 9
    ids = torch.randint(0, ref.config.vocab_size, (2, 10), generator=gen)
    assert_trains_alike(ref, fused, ids)
