"""gpt_oss specifics: kt-ft's reading of transformers' GptOssExperts (layout, biases, clamped swish)
checked against transformers' own module, the layout check, no copy of the base weights, and the
adapter round trip, merge and convert on the gpt_oss demo model.

Tolerances: float64 module comparisons 1e-10 (same math, other summation order); fp32 whole-model
logits rtol/atol 1e-5 (as tests/test_export.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.tiny_models import tiny_model
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from kt_ft.backends.base import ExpertWeights, LoraTensors
from kt_ft.backends.reference import reference_moe
from kt_ft.backends.registry import BACKENDS
from kt_ft.base.errors import KTConfigError
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.family import expert_spec, find_routed_experts
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.patch import replace_routed_experts

if "gpt_oss" not in CONFIG_MAPPING:
    pytest.skip("gpt_oss is not in this transformers", allow_module_level=True)

FAM = FAMILIES["gpt_oss"]


def _hf_experts(seed=0, dtype=torch.float64):
    """Layer 0's GptOssExperts of the tiny model (biases N(0, 5^2): a sixth past the limit)."""
    return tiny_model("gpt_oss", seed=seed).model.layers[0].mlp.experts.to(dtype)


def _random_lora(e, h, i, r, gen, dtype=torch.float64):
    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return LoraTensors(rnd(e, r, h, scale=h**-0.5), rnd(e, i, r, scale=0.3), rnd(e, r, h, scale=h**-0.5),
                       rnd(e, i, r, scale=0.3), rnd(e, r, i, scale=i**-0.5), rnd(e, h, r, scale=0.3))  # fmt: skip


def _merged_hf(hf, lora: LoraTensors, s: float):
    """A copy of HF's module with s * B @ A folded into its own weights, written from
    transformers' layout alone: gate_up_proj[e] [H, 2I] is x @ W with gate columns 0::2, up 1::2."""
    import copy

    m = copy.deepcopy(hf)  # (its config too: the implementation switch below stays local)
    with torch.no_grad():
        for e in range(hf.num_experts):
            m.gate_up_proj[e][:, 0::2] += (s * lora.gate_b[e] @ lora.gate_a[e]).T
            m.gate_up_proj[e][:, 1::2] += (s * lora.up_b[e] @ lora.up_a[e]).T
            m.down_proj[e] += (s * lora.down_b[e] @ lora.down_a[e]).T
    return m


def test_kt_reads_gpt_oss_experts_as_transformers_computes_them(rng):
    """reference loop and the torch backend (through KTExperts) == transformers' GptOssExperts with
    the LoRA merged into its weights, float64, on inputs that hit both sides of both clamps."""
    hf = _hf_experts()
    e, h, two_i = hf.gate_up_proj.shape
    t, k, s = 40, 2, 1.5
    x = torch.randn(t, h, generator=rng, dtype=torch.float64)
    ids = torch.stack([torch.randperm(e, generator=rng)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=rng, dtype=torch.float64), -1)
    lora = _random_lora(e, h, two_i // 2, 4, rng)
    spec = expert_spec(FAM, hf)
    assert (spec.alpha, spec.limit, spec.transposed, spec.interleaved) == (1.702, 7.0, True, True)

    merged = _merged_hf(hf, lora, s)
    with torch.no_grad():
        # transformers' two float64-capable implementations: the modeling file's loop and batched_mm
        merged.config._experts_implementation = "eager"
        want = merged(x, ids, w)
        merged.config._experts_implementation = "batched_mm"
        torch.testing.assert_close(merged(x, ids, w), want, rtol=1e-10, atol=1e-10)
        gu = torch.einsum("th,ehj->tej", x, hf.gate_up_proj) + hf.gate_up_proj_bias  # all experts, no LoRA
    g, u = gu[..., 0::2], gu[..., 1::2]
    assert (g > 7).any() and (g < 7).any() and (u > 7).any() and (u < -7).any(), "clamps not exercised"

    base = ExpertWeights(hf.gate_up_proj, hf.down_proj, hf.gate_up_proj_bias, hf.down_proj_bias, spec=spec)
    torch.testing.assert_close(reference_moe(x, ids, w, base, lora, s), want, rtol=1e-10, atol=1e-10)
    kt = KTExperts(
        hf,
        layer_idx=0,
        rank=4,
        scaling=s,
        backend=BACKENDS["torch"](),
        chunk_size=16,
        threads=None,
        spec=spec,
    )
    with torch.no_grad():
        for name, tensor in zip(lora._fields, lora):
            getattr(kt, name).data = tensor.clone()
        torch.testing.assert_close(kt(x, ids, w), want, rtol=1e-10, atol=1e-10)


def test_kt_experts_keep_hf_tensors_without_a_copy():
    """KTExperts holds HF's own Parameter objects (weights and biases, frozen, same names) and the
    kernels read their storage: no second copy of the experts in RAM."""
    model = tiny_model("gpt_oss")
    hf = [layer.mlp.experts for layer in model.model.layers]
    ptrs = [{n: p.data_ptr() for n, p in m.named_parameters()} for m in hf]
    plan = make_plan(model, load_rules(resolve_rule_path(FAM.builtin_rule)), FAM, "auto", 1)
    summary = replace_routed_experts(model, plan, 4, 2.0, 64)
    assert "torch" in summary.backend and "skipped kt-kernel" in summary.backend_reason
    kt = [layer.mlp.experts for layer in model.model.layers]
    assert all(isinstance(m, KTExperts) for m in kt)
    for m, before in zip(kt, ptrs):
        base = {n: p for n, p in m.named_parameters() if not n.endswith(("_a", "_b"))}
        assert {n: p.data_ptr() for n, p in base.items()} == before
        assert not any(p.requires_grad for p in base.values())
        assert m.runner.base.gate_up.data_ptr() == before["gate_up_proj"]
        assert m.runner.base.gate_up_bias.data_ptr() == before["gate_up_proj_bias"]
    assert summary.expert_bytes == sum(p.numel() * 4 for m in kt for p in m.base_parameters())
    assert (kt[0].hidden_dim, kt[0].intermediate_dim, kt[0].gate_b.shape) == (64, 32, (8, 32, 4))


def test_layout_check_runs_transformers_gate():
    """The check runs the module's own _apply_gate on probe values: a changed limit is read (the spec
    follows it), a different activation is refused, naming it."""
    hf = _hf_experts(dtype=torch.float32)
    hf.limit = 5.0
    find_routed_experts(nn.ModuleDict({"mlp": nn.ModuleDict({"experts": hf})}), FAM)  # accepted
    assert expert_spec(FAM, hf).limit == 5.0

    class OtherGate(type(hf)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            return (up + 1) * gate * torch.sigmoid(gate * self.alpha)  # no clamp

    hf.__class__ = OtherGate
    with pytest.raises(
        KTConfigError, match=r"_apply_gate \(OtherGate\) does not compute kt-ft's clamped swish"
    ):
        find_routed_experts(
            nn.ModuleDict({"experts": hf}), FAM.__class__(**{**vars(FAM), "experts_class": "OtherGate"})
        )


# --- the adapter on the gpt_oss demo model, through LLaMA-Factory ------------------------------


@pytest.fixture(scope="module")
def gpt_oss_adapter(tmp_path_factory):
    pytest.importorskip("llamafactory")
    from helpers.kt_adapters import random_lora_adapter

    from kt_ft.integrations.demo.text import make_demo_model

    assets = make_demo_model(tmp_path_factory.mktemp("gpt_oss_demo"), family="gpt_oss")
    out = tmp_path_factory.mktemp("gpt_oss_adapter") / "out"
    model, ref, _ = random_lora_adapter(assets, out)
    return assets, out, model, ref


def test_adapter_round_trip(gpt_oss_adapter):
    """Saved (both files, manifest) and reloaded for inference by LLaMA-Factory: same logits."""
    from helpers.kt_adapters import lf_load, logits

    assets, out, model, ref = gpt_oss_adapter
    fused = load_file(str(out / "fused_expert_lora.safetensors"))
    assert fused["layers.1.experts.gate_lora_b"].shape == (8, 32, 8)  # [E, I, r] whatever the base layout
    assert fused["layers.1.experts.down_lora_a"].shape == (8, 8, 32)  # [E, r, I]
    reloaded = lf_load(assets, False, adapter_name_or_path=str(out))
    torch.testing.assert_close(logits(reloaded), ref, rtol=1e-5, atol=1e-5)


def test_merge_folds_lora_into_gpt_oss_layout(gpt_oss_adapter, tmp_path):
    """kt-ft merge on the gpt_oss base (fused [E, H, 2I] interleaved / [E, I, H], biases): the plain
    transformers model from the merged checkpoint gives the adapter's logits; biases unchanged."""
    from transformers import AutoModelForCausalLM

    from kt_ft.integrations.cli.main import main

    assets, out, _, ref = gpt_oss_adapter
    assert main(["merge", str(out), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        from helpers.kt_adapters import TOKENS

        got = merged(input_ids=TOKENS).logits.float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    a, b = (
        load_file(str(assets / "model" / "model.safetensors")),
        load_file(str(tmp_path / "merged" / "model.safetensors")),
    )
    key = "model.layers.0.mlp.experts"
    assert torch.equal(a[f"{key}.gate_up_proj_bias"], b[f"{key}.gate_up_proj_bias"])
    assert not torch.equal(a[f"{key}.gate_up_proj"], b[f"{key}.gate_up_proj"]), "nothing was merged"


def test_merge_refuses_an_mxfp4_base(gpt_oss_adapter, tmp_path):
    """The hub checkpoints store the experts MXFP4 (``*_blocks`` / ``*_scales``): refused by name."""
    from kt_ft.integrations.export.merge import merge_adapter

    assets, out, _, _ = gpt_oss_adapter
    base = tmp_path / "mxfp4"
    shutil.copytree(assets / "model", base)
    tensors = load_file(str(base / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        t = tensors.pop(key)
        tensors[f"{key}_blocks"] = torch.zeros(t.shape[0], 4, dtype=torch.uint8)
        tensors[f"{key}_scales"] = torch.zeros(t.shape[0], 4, dtype=torch.uint8)
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KTConfigError, match=r"model.layers.0.mlp.experts MXFP4-quantized.*kt-ft convert"):
        merge_adapter(out, tmp_path / "m", base=base)
    assert json.loads((base / "config.json").read_text())["model_type"] == "gpt_oss"


def test_rules_plan_reads_the_gpt_oss_layout(gpt_oss_adapter, capsys):
    """`kt-ft rules plan` on the gpt_oss demo: expert LoRA counted from [E, H, 2I] (H 64, I 32), as
    the model built it (r 8 by default: 2 layers x 3 x E 8 x r 8 x (H + I))."""
    from kt_ft.integrations.cli.main import main

    assets, _, model, _ = gpt_oss_adapter
    assert main(["rules", "plan", "--rule", "gpt_oss", "--model", str(assets / "model"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    built = sum(p.numel() for m in model.modules() if isinstance(m, KTExperts) for p in m.lora_tensors())
    assert report["lora"]["expert_params"] == 2 * 3 * 8 * 8 * (64 + 32) == built


class GptOssExpertMLP(nn.Module):
    """One gpt_oss expert as per-expert nn.Linear modules (with biases), the layout `kt-ft convert`
    writes LoRA for: gate_proj / up_proj [I, H], down_proj [H, I]."""

    def __init__(self, hf, e: int) -> None:
        super().__init__()
        h, two_i = hf.gate_up_proj.shape[1:]
        self.gate_proj, self.up_proj = nn.Linear(h, two_i // 2), nn.Linear(h, two_i // 2)
        self.down_proj = nn.Linear(two_i // 2, h)
        self.alpha, self.limit = hf.alpha, hf.limit
        gu, b = hf.gate_up_proj.detach()[e], hf.gate_up_proj_bias.detach()[e]  # [H, 2I], [2I]
        with torch.no_grad():
            for lin, w, bias in ((self.gate_proj, gu[:, 0::2].T, b[0::2]), (self.up_proj, gu[:, 1::2].T, b[1::2]),
                                 (self.down_proj, hf.down_proj.detach()[e].T, hf.down_proj_bias.detach()[e])):  # fmt: skip
                lin.weight.copy_(w)
                lin.bias.copy_(bias)

    def forward(self, x):
        g = self.gate_proj(x).clamp(max=self.limit)
        u = self.up_proj(x).clamp(-self.limit, self.limit)
        return self.down_proj((u + 1) * g * torch.sigmoid(self.alpha * g))


class PerExpertGptOss(nn.ModuleList):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            tok, slot = torch.nonzero(top_k_index == e, as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(hidden_states[tok]) * top_k_weights[tok, slot, None])
        return out


def test_convert_gives_the_adapters_logits_on_a_per_expert_gpt_oss(gpt_oss_adapter, tmp_path):
    """`kt-ft convert` (per-expert gate/up/down_proj LoRA, A [r, in], B [out, r]) loaded by PEFT on a
    per-expert gpt_oss model (biases, clamped swish): the adapter's logits, fp32 rtol/atol 1e-5."""
    from helpers.kt_adapters import TOKENS
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kt_ft.integrations.cli.main import main

    assets, out, _, ref = gpt_oss_adapter
    assert main(["convert", str(out), str(tmp_path / "conv")]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"), dtype=torch.float32)
    with torch.no_grad():
        plain = model(input_ids=TOKENS).logits
    for layer in model.model.layers:
        hf = layer.mlp.experts
        layer.mlp.experts = PerExpertGptOss(GptOssExpertMLP(hf, e) for e in range(hf.num_experts))
    with torch.no_grad():  # the per-expert module is the same model before any LoRA
        torch.testing.assert_close(model(input_ids=TOKENS).logits, plain, rtol=1e-5, atol=1e-5)
    peft_model = PeftModel.from_pretrained(model.eval(), str(tmp_path / "conv")).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=TOKENS).logits.float(), ref, rtol=1e-5, atol=1e-5)
