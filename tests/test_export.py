"""kt-ft convert (per-expert PEFT adapter) and kt-ft merge (plain transformers checkpoint)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.kt_adapters import TOKENS
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.cli.main import main

pytest.importorskip("llamafactory")


class ExpertMLP(nn.Module):
    """One routed expert as pre-v5 transformers (and vLLM / SGLang) name it."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(gate.shape[1], gate.shape[0], bias=False)  # [I, H]
        self.up_proj = nn.Linear(up.shape[1], up.shape[0], bias=False)  # [I, H]
        self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False)  # [H, I]
        with torch.no_grad():
            for lin, w in ((self.gate_proj, gate), (self.up_proj, up), (self.down_proj, down)):
                lin.weight.copy_(w)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class PerExpertExperts(nn.ModuleList):
    """Drop-in for transformers 5.6's fused experts module: experts.{e}.{gate,up,down}_proj."""

    @classmethod
    def from_fused(cls, fused: nn.Module) -> PerExpertExperts:
        inter = fused.down_proj.shape[2]
        gu, d = fused.gate_up_proj.detach(), fused.down_proj.detach()  # [E, 2I, H], [E, H, I]
        return cls(ExpertMLP(gu[e, :inter], gu[e, inter:], d[e]) for e in range(gu.shape[0]))

    def forward(self, hidden_states, top_k_index, top_k_weights):  # [T, H], [T, k], [T, k]
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            tok, slot = torch.nonzero(top_k_index == e, as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(hidden_states[tok]) * top_k_weights[tok, slot, None])
        return out


def per_expert_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for layer in model.model.layers:
        layer.mlp.experts = PerExpertExperts.from_fused(layer.mlp.experts)
    return model.eval()


def run(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


def test_per_expert_reference_model_matches_transformers(demo_assets):
    """The test's own reference module is right: fp32, rtol/atol 1e-5 vs transformers' fused experts."""
    fused = AutoModelForCausalLM.from_pretrained(str(demo_assets / "model"), dtype=torch.float32).eval()
    torch.testing.assert_close(run(per_expert_model(demo_assets / "model")), run(fused), rtol=1e-5, atol=1e-5)


def test_convert_loads_in_peft_with_the_same_logits(saved_adapter, demo_assets, tmp_path):
    """PEFT's LoRA on a per-expert model from the converted adapter = kt-ft's model, fp32,
    rtol/atol 1e-5 (per-token expert products vs kt-ft's grouped kernel: summation order)."""
    from peft import PeftModel

    _, src, ref, _ = saved_adapter
    assert main(["convert", str(src), str(tmp_path / "conv")]) == 0
    config = json.loads((tmp_path / "conv" / "adapter_config.json").read_text())
    assert {"gate_proj", "up_proj", "down_proj", "q_proj"} <= set(config["target_modules"])
    assert "kt_ft" not in config
    tensors = load_file(str(tmp_path / "conv" / "adapter_model.safetensors"))
    assert tensors["base_model.model.model.layers.1.mlp.experts.7.gate_proj.lora_A.weight"].shape == (8, 64)
    assert tensors["base_model.model.model.layers.1.mlp.experts.7.down_proj.lora_B.weight"].shape == (64, 8)
    model = PeftModel.from_pretrained(per_expert_model(demo_assets / "model"), str(tmp_path / "conv")).eval()
    torch.testing.assert_close(run(model), ref, rtol=1e-5, atol=1e-5)


def test_convert_split_partitions_the_keys(saved_adapter, tmp_path):
    _, src, _, _ = saved_adapter
    main(["convert", str(src), str(tmp_path / "one")])
    assert main(["convert", str(src), str(tmp_path / "split"), "--split"]) == 0
    one = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    experts = load_file(str(tmp_path / "split" / "experts" / "adapter_model.safetensors"))
    rest = load_file(str(tmp_path / "split" / "non_experts" / "adapter_model.safetensors"))
    assert (
        experts
        and rest
        and all(".mlp.experts." in k for k in experts)
        and not any(".experts." in k for k in rest)
    )
    assert set(experts) | set(rest) == set(one) and not set(experts) & set(rest)
    assert all(torch.equal(one[k], t) for k, t in {**experts, **rest}.items())
    cfg = json.loads((tmp_path / "split" / "experts" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "up_proj"]


def test_merge_gives_the_adapters_logits(saved_adapter, tmp_path):
    """Merged plain transformers model vs kt-ft base+adapter: fp32, rtol/atol 1e-5."""
    _, src, ref, _ = saved_adapter
    assert main(["merge", str(src), str(tmp_path / "merged")]) == 0  # base from the manifest
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    torch.testing.assert_close(run(merged), ref, rtol=1e-5, atol=1e-5)


def test_merge_refuses_another_base_model(saved_adapter, demo_assets, tmp_path, capsys):
    _, src, _, _ = saved_adapter
    other = tmp_path / "other"
    shutil.copytree(demo_assets / "model", other)
    (other / "config.json").write_text((other / "config.json").read_text().replace("{", '{"x": 1,', 1))
    assert main(["merge", str(src), str(tmp_path / "merged"), "--base", str(other)]) == 2
    assert "other/config.json: sha256 differs" in capsys.readouterr().err
    with pytest.raises(KTConfigError, match="trained on another base model"):
        from kt_ft.integrations.export.merge import merge_adapter

        merge_adapter(src, tmp_path / "m2", base=other)


def test_merge_into_a_fused_expert_checkpoint(saved_adapter, demo_assets, tmp_path):
    """A base stored with fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) merges to
    the same weights as the per-expert one, stacked: exact up to fp32 rounding (atol 1e-6)."""
    _, src, _, _ = saved_adapter
    fused_base = tmp_path / "fused_base"
    shutil.copytree(demo_assets / "model", fused_base)
    per = load_file(str(fused_base / "model.safetensors"))
    fused = {k: v for k, v in per.items() if ".mlp.experts." not in k}
    for layer in (0, 1):
        t = f"model.layers.{layer}.mlp.experts"
        fused[f"{t}.gate_up_proj"] = torch.stack(
            [torch.cat([per[f"{t}.{e}.gate_proj.weight"], per[f"{t}.{e}.up_proj.weight"]]) for e in range(8)]
        )
        fused[f"{t}.down_proj"] = torch.stack([per[f"{t}.{e}.down_proj.weight"] for e in range(8)])
    save_file(fused, str(fused_base / "model.safetensors"), metadata={"format": "pt"})

    main(["merge", str(src), str(tmp_path / "m_per"), "--base", str(demo_assets / "model")])
    main(["merge", str(src), str(tmp_path / "m_fused"), "--base", str(fused_base)])
    a = load_file(str(tmp_path / "m_per" / "model.safetensors"))
    b = load_file(str(tmp_path / "m_fused" / "model.safetensors"))
    for layer in (0, 1):
        t = f"model.layers.{layer}.mlp.experts"
        for e in range(8):
            gate, up = b[f"{t}.gate_up_proj"][e].chunk(2)
            torch.testing.assert_close(gate, a[f"{t}.{e}.gate_proj.weight"], rtol=0, atol=1e-6)
            torch.testing.assert_close(up, a[f"{t}.{e}.up_proj.weight"], rtol=0, atol=1e-6)
            torch.testing.assert_close(
                b[f"{t}.down_proj"][e], a[f"{t}.{e}.down_proj.weight"], rtol=0, atol=1e-6
            )
        assert not torch.equal(b[f"{t}.down_proj"], fused[f"{t}.down_proj"]), "nothing was merged"
