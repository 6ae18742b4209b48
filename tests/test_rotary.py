"""The fused rotary embedding (kt_ft/backends/rotary.py) against transformers' apply_rotary_pos_emb.

Reference: the family's own function (kept as ``_kt_ft_original``) on the same fresh random inputs
(seed printed), outputs and gradients of q and k. Tolerances: fp32 1e-5 relative to the largest
value; bf16 one rounding step (1e-2).
"""

import copy

import pytest
import torch
from helpers.compare import assert_close as _close
from helpers.compare import assert_trains_alike
from helpers.compare import fresh_seed as _seed

transformers = pytest.importorskip("transformers")

from kt_ft.backends.rotary import install_fused_rotary, uninstall_fused_rotary  # noqa: E402


def _tiny(family="qwen3_moe", seed=0):
    from helpers.tiny_models import tiny_model

    # GLM-4.5 rotates part of each head
    return tiny_model(family, seed=seed, **({"partial_rotary_factor": 0.5} if family == "glm4_moe" else {}))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_rotary_matches_the_familys_function(dtype, tol, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as family

    gen = torch.Generator().manual_seed(_seed())
    own = family.apply_rotary_pos_emb
    assert install_fused_rotary(_tiny()) == ["transformers.models.qwen3_moe.modeling_qwen3_moe"]
    try:
        fused = family.apply_rotary_pos_emb
        assert fused is not own and fused._kt_ft_original is own
        q = torch.randn(2, 8, 7, 16, generator=gen).to(device=device, dtype=dtype)
        k = torch.randn(2, 2, 7, 16, generator=gen).to(device=device, dtype=dtype)
        angle = torch.randn(2, 7, 8, generator=gen) * 3
        cos = torch.cat((angle, angle), -1).cos().to(device=device, dtype=dtype)
        sin = torch.cat((angle, angle), -1).sin().to(device=device, dtype=dtype)
        weights = (
            torch.randn(2, 8, 7, 16, generator=gen).to(device),
            torch.randn(2, 2, 7, 16, generator=gen).to(device),
        )
        results = []
        for fn in (own, fused):
            qi, ki = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
            qo, ko = fn(qi, ki, cos, sin)
            ((qo.float() * weights[0]).sum() + (ko.float() * weights[1]).sum()).backward()
            results.append((qo.detach(), ko.detach(), qi.grad, ki.grad))
        for a, b, what in zip(results[1], results[0], ("q", "k", "q gradient", "k gradient")):
            assert a.dtype == b.dtype, what
            _close(a, b, tol, what)
        # heads after the tokens ([B, T, H, D]): the call names unsqueeze_dim
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        for a, b in zip(fused(qt, kt, cos, sin, unsqueeze_dim=2), own(qt, kt, cos, sin, unsqueeze_dim=2)):
            _close(a, b, tol, "q, k with unsqueeze_dim=2")
    finally:
        uninstall_fused_rotary()
    assert family.apply_rotary_pos_emb is own


def test_partial_rotary_and_off_keep_the_familys_function(monkeypatch):
    """GLM-4.5 rotates part of each head: its calls go to its own function, with the same result."""
    gen = torch.Generator().manual_seed(_seed())
    ref = _tiny("glm4_moe", seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    ids = torch.randint(0, ref.config.vocab_size, (1, 9), generator=gen)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        install_fused_rotary(ref)
        got = ref(input_ids=ids).logits
    uninstall_fused_rotary()
    assert torch.equal(got, want)
    monkeypatch.setenv("KT_FT_FUSIONS", "lora+norm+loss")  # all but rope
    assert install_fused_rotary(_tiny()) == []


def test_a_tiny_moe_trains_the_same_with_the_fused_rotary():
    gen = torch.Generator().manual_seed(_seed())
    ref = _tiny(seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    twin = copy.deepcopy(ref)
    ids = torch.randint(0, ref.config.vocab_size, (2, 11), generator=gen)
    installed = []
    assert_trains_alike(ref, twin, ids, before_twin=lambda: installed.extend(install_fused_rotary(twin)))
    uninstall_fused_rotary()
    assert installed == ["transformers.models.qwen3_moe.modeling_qwen3_moe"]
