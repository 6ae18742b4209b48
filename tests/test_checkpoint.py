"""fused_expert_lora.safetensors: layout, atomic write, round trip, fail closed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_model

from kt_ft.checkpoint import FUSED_FILE, load_fused_expert_lora, save_fused_expert_lora
from kt_ft.errors import KTConfigError
from kt_ft.models import FAMILIES
from kt_ft.moe.experts import KTExperts
from kt_ft.moe.patch import replace_routed_experts
from kt_ft.rules import load_rules, make_plan, resolve_rule_path


def kt_model(seed=0, rank=4):
    model = tiny_model(seed=0)
    plan = make_plan(model, load_rules(resolve_rule_path("qwen3_moe")), FAMILIES["qwen3_moe"], "torch", 1)
    replace_routed_experts(model, plan, rank, 2.0, 64, seed=seed)
    return model


def test_round_trip_and_layout(tmp_path):
    src = kt_model(seed=1)
    with torch.no_grad():
        for m in src.modules():
            if isinstance(m, KTExperts):
                m.down_b.normal_()
    save_fused_expert_lora(src, tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name != FUSED_FILE], "temporary file left behind"
    tensors = load_file(str(tmp_path / FUSED_FILE))
    assert tensors["layers.1.experts.gate_lora_a"].shape == (8, 4, 64)
    assert tensors["layers.1.experts.down_lora_b"].shape == (8, 64, 4)
    assert all(t.dtype == torch.float32 for t in tensors.values()), "stored in the training dtype (lossless)"

    dst = kt_model(seed=2)
    assert load_fused_expert_lora(dst, tmp_path) == 2
    for a, b in zip(
        [m for m in src.modules() if isinstance(m, KTExperts)],
        [m for m in dst.modules() if isinstance(m, KTExperts)],
    ):
        for ta, tb in zip(a.lora_tensors(), b.lora_tensors()):
            assert torch.equal(ta, tb)


def test_missing_file_and_wrong_shapes_fail_closed(tmp_path):
    model = kt_model()
    with pytest.raises(KTConfigError, match="fused_expert_lora.safetensors: missing"):
        load_fused_expert_lora(model, tmp_path)
    save_fused_expert_lora(kt_model(rank=2), tmp_path)
    with pytest.raises(
        KTConfigError,
        match=r"layers.0.experts.gate_lora_a has shape \(8, 2, 64\), the model needs \(8, 4, 64\)",
    ):
        load_fused_expert_lora(model, tmp_path)
    t = load_file(str(tmp_path / FUSED_FILE))
    del t["layers.1.experts.up_lora_b"]
    save_file(t, str(tmp_path / FUSED_FILE))
    with pytest.raises(KTConfigError, match="layers.1.experts.up_lora_b missing"):
        load_fused_expert_lora(kt_model(rank=2), tmp_path)
