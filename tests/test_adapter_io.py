"""The adapter directory in-process: save through the hooked save_pretrained, reload for
inference through LLaMA-Factory's loader, resume-style load_adapter, and fail-closed checks."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from helpers.kt_adapters import lf_load, logits

from kt_ft.base.errors import KTConfigError
from kt_ft.base.settings import changed
from kt_ft.formats.manifest import MANIFEST_FILE, verify_adapter_dir
from kt_ft.runtime.experts import KTExperts

pytest.importorskip("llamafactory")


def test_saved_dir_layout(saved_adapter):
    _, out, _, _ = saved_adapter
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "fused_expert_lora.safetensors",
        "kt_expert_lora_master.safetensors",
    }
    assert manifest["lora"] == {"rank": 8, "alpha": 16, "use_rslora": False}
    assert manifest["settings"] == changed()  # the KT_FT_* switches the save ran with, when not default
    assert manifest["fused_tensors"]["layers.1.experts.down_lora_b"] == {"shape": [8, 64, 8], "dtype": "BF16"}
    block = json.loads((out / "adapter_config.json").read_text())["kt_ft"]
    assert block["expert_targets"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert (block["r"], block["lora_alpha"], block["backend"]) == (8, 16, "torch")
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_reload_for_inference_gives_the_same_logits(saved_adapter, demo_assets):
    """LLaMA-Factory's inference load (PEFT merges the non-expert LoRA into the base weights,
    kt-ft loads the expert LoRA): fp32, rtol 1e-5 / atol 1e-5 (merging reorders the sums)."""
    _, out, ref, _ = saved_adapter
    model = lf_load(demo_assets, False, adapter_name_or_path=str(out))
    kt = [m for m in model.modules() if isinstance(m, KTExperts)]
    assert kt and not any(p.requires_grad for m in kt for p in m.lora_tensors())
    torch.testing.assert_close(logits(model), ref, rtol=1e-5, atol=1e-5)
    # what `llamafactory-cli export` does next: refused (the expert LoRA would be dropped silently)
    with pytest.raises(KTConfigError, match=r"run `kt-ft merge ADAPTER_DIR OUT`"):
        model.save_pretrained(str(out.parent / "export"))


def test_load_adapter_restores_both_parts_and_keeps_expert_lora_trainable(saved_adapter):
    """What the HF Trainer calls on resume. Exact (tolerance 0): the files are fp32."""
    model, out, _, state = saved_adapter
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
                p.requires_grad_(False)  # also check requires_grad comes back
    model.load_adapter(str(out), "default", is_trainable=True)
    now = dict(model.named_parameters())
    for name, want in state.items():
        assert torch.equal(now[name], want), name
        if ".experts." in name:
            assert now[name].requires_grad, f"{name} frozen after load_adapter"


@pytest.fixture
def copy_of(saved_adapter, tmp_path):
    _, out, _, _ = saved_adapter
    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    return dst


@pytest.fixture
def info(saved_adapter):
    return saved_adapter[0]._kt_ft_info


def test_fail_closed_missing_fused_file(copy_of, info):
    (copy_of / "fused_expert_lora.safetensors").unlink()
    with pytest.raises(KTConfigError, match=r"copy/fused_expert_lora.safetensors: missing \(listed in"):
        verify_adapter_dir(copy_of, info)


def test_fail_closed_truncated_fused_file(copy_of, info):
    f = copy_of / "fused_expert_lora.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(
        KTConfigError, match=r"fused_expert_lora.safetensors: size \d+ bytes, .* says \d+ \(truncated\?\)"
    ):
        verify_adapter_dir(copy_of, info)


def test_fail_closed_wrong_sha256(copy_of, info):
    f = copy_of / "fused_expert_lora.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01  # same size, one bit of one tensor value
    f.write_bytes(bytes(data))
    with pytest.raises(KTConfigError, match=r"fused_expert_lora.safetensors: sha256 [0-9a-f]{16}\.\.\., "):
        verify_adapter_dir(copy_of, info)


def test_fail_closed_wrong_rank(copy_of, info):
    with pytest.raises(KTConfigError, match=r"kt_adapter_manifest.json: lora.rank=8 but this run has rank=4"):
        verify_adapter_dir(copy_of, dataclasses.replace(info, rank=4))


def test_fail_closed_missing_manifest(copy_of, info):
    (copy_of / MANIFEST_FILE).unlink()
    with pytest.raises(
        KTConfigError, match=r"kt_adapter_manifest.json: missing: the save into .* did not finish"
    ):
        verify_adapter_dir(copy_of, info)


def test_fail_closed_other_base_model_through_llamafactory(saved_adapter, demo_assets, tmp_path):
    """Real load path: an adapter trained on the demo model, loaded onto a model whose
    config.json differs (one more key), stops before any expert LoRA is used."""
    _, out, _, _ = saved_adapter
    other = tmp_path / "other_model"
    shutil.copytree(demo_assets / "model", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["kt_ft_test_marker"] = 1
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KTConfigError, match=r"this adapter belongs to another base model"):
        lf_load(demo_assets, False, model_dir=other, adapter_name_or_path=str(out))
