"""Every model type whose experts use transformers' experts interface: kt-ft trains it, or refuses it.

For each type of the installed transformers (``kt_ft.integrations.cli.probe.interface_model_types``) a tiny
random model is built from its config class's defaults (``kt_ft/plan/tiny.py``). A type kt-ft
computes is checked against an independent reference: the original transformers modules in
``eager`` mode with the expert LoRA merged into their own weights (W + s B A written into HF's
layout, differentiable through ``torch.func.functional_call``), vs kt-ft's model (its experts
replaced by KTExperts through the family's built-in rule, torch backend). One forward/backward on
fresh random tokens (seed printed); fp32, tolerances: loss rel 1e-5, expert-LoRA grads and every
other parameter's grad rel 1e-4 / abs 1e-6. A type kt-ft refuses must be refused with the reason.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch.func import functional_call

from kt_ft.base.errors import KTConfigError
from kt_ft.formats.lora_layout import LORA_NAMES
from kt_ft.integrations.cli.probe import interface_model_types
from kt_ft.integrations.demo.text import randomize_routing
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.derived import GENERIC_RULE, OVERRIDES
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.family import expert_spec, family_of, find_routed_experts
from kt_ft.plan.interface import derive_spec, interface_experts, is_interface_experts
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.plan.tiny import tiny_config
from kt_ft.runtime.dispatch import IMPLEMENTATION, kt_ft_experts_forward, use_kt_ft_experts
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.patch import replace_routed_experts

TYPES = interface_model_types()
RANK, SCALING = 4, 2.0


def _tiny(model_type: str, seed: int):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_routing(model)
    return model


def _merged(hf, kt: KTExperts) -> dict[str, torch.Tensor]:
    """HF's gate_up_proj / down_proj with kt's expert LoRA added in HF's own layout, as functions
    of the LoRA tensors (leaves of the reference's graph: their grads are the reference's)."""
    spec = kt.spec
    lora = {n: getattr(kt, n).detach().clone().requires_grad_(True) for n in LORA_NAMES}
    i = kt.intermediate_dim
    dg = SCALING * torch.bmm(lora["gate_b"], lora["gate_a"])  # [E, I, H]
    du = SCALING * torch.bmm(lora["up_b"], lora["up_a"])
    dd = SCALING * torch.bmm(lora["down_b"], lora["down_a"])  # [E, H, I]
    gs, us = spec.gate_up_cols(i)
    delta = torch.zeros(kt.num_experts, 2 * i, kt.hidden_dim)
    delta[:, gs], delta[:, us] = dg, du  # [E, 2I, H]
    if spec.transposed:
        delta, dd = delta.transpose(1, 2), dd.transpose(1, 2)
    return {"gate_up_proj": hf.gate_up_proj.detach() + delta, "down_proj": hf.down_proj.detach() + dd}, lora


@pytest.mark.parametrize("model_type", TYPES)
def test_interface_type_trains_or_is_refused(model_type):
    seed = random.randrange(2**31)
    print(f"{model_type}: seed {seed}")
    config = tiny_config(model_type)
    decorated = interface_experts(_meta(config))
    gated = all(getattr(m, "has_gate", True) for _, m in decorated)
    assert decorated, f"{model_type}: no experts-interface module in its tiny model"
    if not gated:  # kt-ft's CPU op computes gated experts only: refused before any weight exists
        with pytest.raises(KTConfigError) as err:
            family_of(config)
        msg = str(err.value)
        assert f"model_type={model_type!r} is not supported" in msg and "has_gate=False" in msg
        assert type(decorated[0][1].act_fn).__name__ in msg and "CPU op computes" in msg
        return
    family = family_of(config)
    if model_type not in {t for f in FAMILIES.values() for t in f.model_types}:
        assert family.expert_layout == "interface"
        assert family.builtin_rule in (GENERIC_RULE, model_type)

    ref = _tiny(model_type, seed)
    model = copy.deepcopy(ref)
    plan = make_plan(model, load_rules(resolve_rule_path(family.builtin_rule)), family, "torch", 1)
    replace_routed_experts(model, plan, RANK, SCALING, 4096, seed=seed)
    kt = {n: m for n, m in model.named_modules() if isinstance(m, KTExperts)}
    assert kt and len(kt) == len(interface_experts(ref))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-zero B: the expert LoRA contributes
        for m in kt.values():
            for n in ("gate_b", "up_b", "down_b"):
                getattr(m, n).normal_(0, 0.05, generator=gen)
    use_kt_ft_experts(ref, "eager")
    overrides, leaves = {}, {}
    for name, m in kt.items():
        merged, lora = _merged(ref.get_submodule(name), m)
        overrides |= {f"{name}.{k}": v for k, v in merged.items()}
        leaves |= {f"{name}.{k}": v for k, v in lora.items()}
    ids = torch.randint(3, config.get_text_config().vocab_size, (2, 12), generator=gen)

    loss_kt = model(input_ids=ids, labels=ids).loss
    loss_kt.backward()
    loss_ref = functional_call(
        ref, overrides, args=(), kwargs=dict(input_ids=ids, labels=ids), strict=False
    ).loss
    loss_ref.backward()
    torch.testing.assert_close(loss_kt, loss_ref, rtol=1e-5, atol=0)
    for key, leaf in leaves.items():
        got = model.get_submodule(key.rpartition(".")[0]).get_parameter(key.rpartition(".")[2]).grad
        assert leaf.grad is not None and got is not None, key
        torch.testing.assert_close(got, leaf.grad, rtol=1e-4, atol=1e-6, msg=key)
    assert any(leaf.grad.abs().max() > 0 for leaf in leaves.values())
    ref_params = dict(ref.named_parameters())
    checked = 0
    for n, p in model.named_parameters():
        if p.requires_grad and n in ref_params and ref_params[n].grad is not None:
            # fp32, summed in another order: within 1e-4 relative, or 1e-4 of the tensor's largest
            # entry (an embedding row summed over many tokens can cancel to near zero)
            want = ref_params[n].grad
            atol = max(1e-6, 1e-4 * float(want.abs().max()))
            torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
            checked += 1
    assert checked > 0


def _meta(config):
    from kt_ft.formats.skeleton import meta_model

    return meta_model(config, torch.bfloat16)


def test_types_found():
    """The probe finds the interface types of this transformers, the hand families among them."""
    assert {"qwen3_moe", "mixtral", "gpt_oss"} <= set(TYPES)
    assert len(TYPES) >= 20


@pytest.mark.parametrize("family", list(FAMILIES))
def test_derived_spec_equals_hand_family_spec(family):
    """For every hand-written family the spec read off the module is the one the table says."""
    from helpers.tiny_models import tiny_model

    model = tiny_model(family)
    for name, module in find_routed_experts(model, FAMILIES[family]):
        assert is_interface_experts(module), name
        spec, problems = derive_spec(module)
        assert not problems and spec == expert_spec(FAMILIES[family], module), (name, spec)


def test_experts_function_registered_and_dispatches():
    """'kt_ft' is in transformers' ALL_EXPERTS_FUNCTIONS once kt-ft applies, and a decorated module
    set to it answers through kt-ft's CPU op: logits equal eager's to 1e-5 (gelu_tanh experts)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model = _tiny("gemma4_text", 0)
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        use_kt_ft_experts(model, "eager")
        eager = model(input_ids=ids).logits
        use_kt_ft_experts(model)
        assert ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] is kt_ft_experts_forward
        kt = model(input_ids=ids).logits
    assert all(hasattr(m, "_kt_ft_runner") for _, m in interface_experts(model))
    torch.testing.assert_close(kt, eager, rtol=0, atol=1e-5)


def test_unsupported_activation_refused_with_what_was_found():
    """A gated experts module whose activation the op lacks (relu) is refused before any weight
    loads, naming the model type, the act_fn and _apply_gate found, and what is supported."""
    config = tiny_config("dots1", hidden_act="relu")
    with pytest.raises(KTConfigError) as err:
        family_of(config)
    msg = str(err.value)
    assert "model_type='dots1' is not supported" in msg and "ReLU" in msg
    assert "_apply_gate" in msg and "silu(gate) * up, gelu_tanh(gate) * up" in msg


def test_tiny_gemma_per_layer_vocab_follows_vocab_size():
    """Gemma's per-layer-input embeddings take the same token ids as embed_tokens: a demo's
    vocab_size (its tokenizer's size) sizes both (a fixed 97 made LF's forward index past it)."""
    assert tiny_config("gemma4_text", vocab_size=400).vocab_size_per_layer_input == 400
    assert (
        tiny_config("gemma4_text", vocab_size=400, vocab_size_per_layer_input=50).vocab_size_per_layer_input
        == 50
    )


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "glm4_moe_lite", "glm_moe_dsa"])
def test_tiny_mla_runs_sdpa_with_padding(model_type):
    """MLA keys carry every head: a tiny MLA config with fewer kv heads failed in LLaMA-Factory
    (SDPA with a padding mask repeats the keys by heads // kv_heads)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    model(input_ids=torch.randint(3, 90, (2, 8)), attention_mask=mask)


def test_dense_model_refused():
    with pytest.raises(
        KTConfigError, match="model_type='llama' is not supported.*use_experts_implementation"
    ):
        family_of(tiny_config("llama"))


def test_override_templates_exist_in_llamafactory():
    templates = pytest.importorskip("llamafactory.data.template").TEMPLATES
    missing = {t: o.template for t, o in OVERRIDES.items() if o.template and o.template not in templates}
    assert not missing


@pytest.mark.parametrize("model_type", ["dots1", "gemma4_text"])
def test_derived_type_through_llamafactory(model_type, tmp_path):
    """`kt-ft make-demo-model --family <derived type>`, loaded by LLaMA-Factory with `use_kt` and
    `lora_target: all` (plan on meta before loading, attach_kt after): experts replaced by
    KTExperts with the derived spec, one forward/backward reaches every expert LoRA B."""
    pytest.importorskip("llamafactory")
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer

    from kt_ft.integrations.cli.main import main

    assert main(["make-demo-model", str(tmp_path / "demo"), "--family", model_type]) == 0
    model_args, _, _, finetuning_args, _ = get_train_args(
        dict(
            model_name_or_path=str(tmp_path / "demo" / "model"), stage="sft", do_train=True,
            finetuning_type="lora", lora_target="all", lora_rank=4, dataset_dir=str(tmp_path / "demo" / "data"),
            dataset="kt_demo", template="qwen", output_dir=str(tmp_path / "out"), report_to="none",
            use_kt=True, cpu_infer=1,
        )
    )  # fmt: skip
    tokenizer = load_tokenizer(model_args)["tokenizer"]
    model = load_model(tokenizer, model_args, finetuning_args, is_trainable=True)
    kt = [m for m in model.modules() if isinstance(m, KTExperts)]
    assert kt and not interface_experts(model)  # every decorated experts module replaced
    if model_type == "gemma4_text":
        assert {m.spec.activation for m in kt} == {"gelu_tanh"}
    ids = torch.randint(1, len(tokenizer), (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(getattr(m, n).grad.abs().max() > 0 for m in kt for n in ("gate_b", "up_b", "down_b"))


def test_readme_model_types_sentence_is_generated_from_docs_models():
    """README's sentence on the experts-interface types is ``kt-ft models --readme``'s, from
    docs/models.md's table as committed; the parser counts what passed (a toy table)."""
    from pathlib import Path

    from kt_ft.integrations.cli.probe import README_BEGIN, README_END, readme_models_block

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    block = readme[readme.index(README_BEGIN) : readme.index(README_END) + len(README_END)]
    assert block == readme_models_block((root / "docs" / "models.md").read_text())
    toy = "\n".join(
        [
            "| a | supported | A | silu | r | d | pass; template `x` |",
            "| b | supported | B | silu | r | d | fail; losses differ |",
            "| c | refused |  |  |  | why | not run (refused) |",
        ]
    )
    got = readme_models_block(toy)
    assert "Of the 3 model types" in got and ", 1 train through" in got and "(a);" in got
    assert "b (fail), c (refused)" in got
