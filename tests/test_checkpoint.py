"""fused_expert_lora.safetensors: layout, atomic write, round trip, fail closed."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import tiny_model
from safetensors.torch import load_file, save_file

from kt_ft.base.errors import KTConfigError
from kt_ft.formats.expert_lora import FUSED_FILE, MASTER_FILE
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.runtime.adapter import load_fused_expert_lora, save_fused_expert_lora
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.patch import replace_routed_experts


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
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([FUSED_FILE, MASTER_FILE]), (
        "temporary file left"
    )
    tensors = load_file(str(tmp_path / FUSED_FILE))
    assert tensors["layers.1.experts.gate_lora_a"].shape == (8, 4, 64)
    assert tensors["layers.1.experts.down_lora_b"].shape == (8, 64, 4)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values()), "KTransformers' interchange dtype"
    master = load_file(str(tmp_path / MASTER_FILE))
    assert master.keys() == tensors.keys() and all(t.dtype == torch.float32 for t in master.values())

    def kt_lora(model):
        return [t for m in model.modules() if isinstance(m, KTExperts) for t in m.lora_tensors()]

    dst = kt_model(seed=2)
    assert load_fused_expert_lora(dst, tmp_path) == 2  # from the master copy: exact
    assert all(torch.equal(a, b) for a, b in zip(kt_lora(src), kt_lora(dst)))
    (tmp_path / MASTER_FILE).unlink()  # e.g. an adapter made by KTransformers: bf16 only
    dst = kt_model(seed=3)
    assert load_fused_expert_lora(dst, tmp_path) == 2
    assert all(torch.equal(a.to(torch.bfloat16).float(), b) for a, b in zip(kt_lora(src), kt_lora(dst)))


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
    t = load_file(str(tmp_path / MASTER_FILE))
    del t["layers.1.experts.up_lora_b"]
    save_file(t, str(tmp_path / MASTER_FILE))
    with pytest.raises(KTConfigError, match="layers.1.experts.up_lora_b missing"):
        load_fused_expert_lora(kt_model(rank=2), tmp_path)
