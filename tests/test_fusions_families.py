"""The three non-expert fusions (LoRA linears, RMSNorm, rotary) on a tiny model of every family.

Each family's tiny model (tests/helpers/tiny_models.py) under PEFT LoRA on every linear layer, against its
copy with the fusions a kt-ft run installs: the loss and every gradient of one forward + backward
(fp32: 1e-5 and 1e-4 relative), so a family whose norm or rotary code differs from the form the
replacements assume fails here (their install checks must have kept its own). Seed printed.
"""

import copy

import pytest
import torch
from helpers.compare import assert_trains_alike
from helpers.compare import fresh_seed as _seed

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from kt_ft.backends.lora_linear import install_fused_lora  # noqa: E402
from kt_ft.backends.rms_norm import install_fused_rms_norm  # noqa: E402
from kt_ft.backends.rotary import install_fused_rotary, uninstall_fused_rotary  # noqa: E402
from kt_ft.plan.families import FAMILIES  # noqa: E402


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_fusions_train_every_family_like_transformers_and_peft(family):
    from helpers.tiny_models import tiny_model

    gen = torch.Generator().manual_seed(_seed())
    base = tiny_model(family, seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    ref = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in ref.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: give the LoRA term a value
            p.data = torch.randn(p.shape, generator=gen) * 0.1
    twin = copy.deepcopy(ref)
    fused, _ = install_fused_lora(twin)
    assert fused > 0
    install_fused_rms_norm(twin)
    ids = torch.randint(0, base.config.vocab_size, (2, 10), generator=gen)
    try:
        assert_trains_alike(ref, twin, ids, before_twin=lambda: install_fused_rotary(twin))
    finally:
        uninstall_fused_rotary()
