"""Vision-language MoE (Qwen3-VL-MoE) through LLaMA-Factory with kt-ft: images, LoRA scopes, parity,
checkpoints and export, on the tiny demo of ``kt-ft make-demo-vl-model`` (chat with the adapter:
``test_multimodal_chat.py``).

LLaMA-Factory runs in this process (``vl_runs.train``, as ``llamafactory-cli train`` calls it): its
import is paid once and each tiny run takes about a second. One trained run (vision + language LoRA,
4 steps, a checkpoint at step 2) is shared by the checkpoint, resume and export tests.

What "changed" means in the scope tests: a LoRA tensor whose value at the end (step 4) differs from
its value at the checkpoint of step 2; a group with no LoRA tensor in the adapter did not change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("llamafactory")

from helpers.vl_runs import train  # noqa: E402

from kt_ft.backends.patch_conv import PatchConv3dAsMatmul, replace_patch_conv3d  # noqa: E402
from kt_ft.integrations.demo.vision import VL_DEMOS, make_demo_vl_model  # noqa: E402
from kt_ft.integrations.llamafactory.patches import conv3d_refused  # noqa: E402

GROUPS = ("vision", "projector", "language", "experts")
# lr-0 losses, use_kt true vs false (fp32; the CPU op sums the top-k in another order than HF)
LOSS_RTOL = 1e-5


# --------------------------------------------------------------------------- helpers


def step_losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def group_of(key: str) -> str:
    """The parameter group of a PEFT adapter key (LLaMA-Factory's keys for qwen3_vl_moe)."""
    if ".visual.merger." in key:
        return "projector"
    if ".visual." in key:  # blocks, and the deepstack mergers (LLaMA-Factory counts them as vision)
        return "vision"
    assert ".language_model." in key, key
    return "language"


def lora_groups(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """group -> {key: tensor} of an adapter dir (PEFT file and kt-ft's expert file)."""
    out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in GROUPS}
    for k, v in load_file(str(directory / "adapter_model.safetensors")).items():
        out[group_of(k)][k] = v
    out["experts"] = load_file(str(directory / "kt_expert_lora_master.safetensors"))
    return out


def changed_groups(run: Path) -> set[str]:
    """Groups with a LoRA tensor that differs between checkpoint-2 and the end of ``run``."""
    before, after = lora_groups(run / "checkpoint-2"), lora_groups(run)
    return {g for g in GROUPS if any(not torch.equal(before[g][k], after[g][k]) for k in after[g])}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def vl_assets(tmp_path_factory):
    return make_demo_vl_model(tmp_path_factory.mktemp("demo_vl"), n=16)


@pytest.fixture(scope="module")
def vl35_assets(tmp_path_factory):
    """The Qwen3.5-MoE vision-language demo (hybrid attention, shared expert)."""
    return make_demo_vl_model(tmp_path_factory.mktemp("demo_vl35"), family="qwen3_5_moe", n=16)


@pytest.fixture(scope="module")
def both_run(vl_assets, tmp_path_factory):
    """Vision tower and language model trained (projector frozen): 4 steps, checkpoint at 2."""
    return train(vl_assets, tmp_path_factory.mktemp("both") / "out", freeze_vision_tower=False)


# --------------------------------------------------------------------------- unit


def test_patch_embed_matmul_equals_conv3d():
    """The swapped patch embedding computes what the Conv3d did (fp32, same Parameters)."""
    gen = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv3d(3, 32, kernel_size=(2, 16, 16), stride=(2, 16, 16), bias=True)
    x = torch.randn(37, 3, 2, 16, 16, generator=gen)
    want = conv(x)
    holder = torch.nn.Sequential(conv)
    assert replace_patch_conv3d(holder) == ["0"]
    swapped = holder[0]
    assert isinstance(swapped, PatchConv3dAsMatmul) and swapped.weight is conv.weight
    torch.testing.assert_close(swapped(x), want, rtol=1e-5, atol=1e-5)
    # an input that is not one kernel per sample still convolves
    wide = torch.randn(2, 3, 2, 32, 16, generator=gen)
    torch.testing.assert_close(swapped(wide), conv(wide), rtol=0, atol=0)
    swapped(x).sum().backward()
    assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0


def test_patch_embed_refuses_other_convs():
    conv = torch.nn.Conv3d(3, 8, kernel_size=3, stride=1)
    with pytest.raises(ValueError, match="stride == kernel_size"):
        replace_patch_conv3d(torch.nn.Sequential(conv))


def test_demo_vl_model_has_the_real_structure(vl_assets):
    """The demo model is a Qwen3-VL-MoE composite; LLaMA-Factory would refuse its Conv3d on this torch
    (so the swap is what lets it run); 2I != H keeps the expert layouts apart."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    config = AutoConfig.from_pretrained(vl_assets / "model")
    assert config.model_type == "qwen3_vl_moe"
    assert 2 * config.text_config.moe_intermediate_size != config.text_config.hidden_size
    model = AutoModelForImageTextToText.from_config(config)
    names = [n for n, m in model.named_modules() if type(m).__name__ == "Qwen3VLMoeTextExperts"]
    assert names == [f"model.language_model.layers.{i}.mlp.experts" for i in range(2)]
    if torch.__version__.startswith("2.9."):
        assert conv3d_refused(model)
    processor = AutoProcessor.from_pretrained(vl_assets / "model")
    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    data = json.loads((vl_assets / "data" / "kt_demo_vl.json").read_text())
    assert (vl_assets / "data" / data[0]["images"][0]).is_file()
    assert data[0]["messages"][0]["content"].startswith("<image>")


def test_rule_names_match_under_peft_and_language_model_prefixes(vl_assets):
    """A rule written for the text model's names places the VL model's experts, with and without
    PEFT's prefix (the meta-skeleton plan and the plan inside PEFT agree)."""
    from transformers import AutoConfig

    from kt_ft.formats.skeleton import meta_model
    from kt_ft.plan.family import family_of
    from kt_ft.plan.loader import load_rules, rule_names
    from kt_ft.plan.placement import make_plan

    assert rule_names("base_model.model.model.language_model.layers.3.mlp.experts") == (
        "model.language_model.layers.3.mlp.experts",
        "model.layers.3.mlp.experts",
    )
    assert rule_names("base_model.model.model.visual.blocks.0.mlp") == ("model.visual.blocks.0.mlp",)
    rule = vl_assets / "rule.yaml"
    rule.write_text(
        '- match:\n    name: "^model\\\\.layers\\\\.\\\\d+\\\\.mlp\\\\.experts$"\n'
        "  replace:\n    device: cpu\n    backend: torch\n- default:\n    device: cpu\n"
    )
    config = AutoConfig.from_pretrained(vl_assets / "model")
    model = meta_model(config, torch.float32)
    peft_like = torch.nn.Module()  # PEFT's nesting: base_model.model.<the model>
    peft_like.base_model = torch.nn.Module()
    peft_like.base_model.model = model
    for top, prefix in ((model, ""), (peft_like, "base_model.model.")):
        plan = make_plan(top, load_rules(rule), family_of(config), "torch", 2)
        assert [e.name for e in plan.experts] == [
            f"{prefix}model.language_model.layers.{i}.mlp.experts" for i in range(2)
        ]


# --------------------------------------------------------------------------- training


def test_trains_with_images_experts_on_the_cpu_op(both_run, vl_assets):
    """The run trained (loss fell), its experts went through kt-ft's CPU op by the built-in rule,
    and the checkpoint names the language model's experts."""
    losses = step_losses(both_run)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    manifest = json.loads((both_run / "kt_adapter_manifest.json").read_text())
    experts = manifest["experts"]
    assert experts["targets"] == [f"model.language_model.layers.{i}.mlp.experts" for i in range(2)]
    assert Path(experts["rule"]).name == "qwen3_vl_moe.yaml"
    fused = load_file(str(both_run / "fused_expert_lora.safetensors"))
    e, h, i = 8, 64, VL_DEMOS["qwen3_vl_moe"].text["moe_intermediate_size"]
    assert fused["layers.0.experts.gate_lora_a"].shape == (e, 8, h)
    assert fused["layers.1.experts.down_lora_b"].shape == (e, h, 8)
    assert fused["layers.1.experts.down_lora_a"].shape == (e, 8, i)


def test_resident_and_streamed_experts_train_like_the_cpu_op(vl_assets, tmp_path):
    """The VL experts placed like any MoE layer's: 2 resident and 3 streamed per layer (on this
    CPU-only machine the "GPU" is the CPU: the split, buffers and schedule run as on a GPU), the rest
    through the CPU op, by a rule written with the text model's names. Against the all-CPU-op
    placement: the first step's loss (rel 1e-5) and every LoRA tensor after the first update (abs
    1e-5 x the tensor's largest entry; seen: 4e-6, summation order through AdamW's first step)."""
    rule = tmp_path / "rule.yaml"
    rule.write_text(
        "- match:\n    name: '^model\\.layers\\.\\d+\\.mlp\\.experts$'\n"
        "  replace:\n    device: cpu\n    backend: torch\n    gpu_experts: 2\n    stream: 3\n"
        "- default: {device: cuda}\n"
    )
    common = dict(freeze_vision_tower=False, max_steps=1, save_steps=1)
    want = train(vl_assets, tmp_path / "cpu", **common)
    got = train(vl_assets, tmp_path / "mixed", kt_optimize_rule=str(rule), **common)
    manifest = json.loads((got / "kt_adapter_manifest.json").read_text())
    assert Path(manifest["experts"]["rule"]).name == "rule.yaml"
    a, b = step_losses(got)[1], step_losses(want)[1]
    assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    ga, gb = lora_groups(got), lora_groups(want)
    for g in GROUPS:
        assert ga[g].keys() == gb[g].keys()
        for k in ga[g]:
            scale = gb[g][k].abs().max().item()
            torch.testing.assert_close(ga[g][k], gb[g][k], rtol=0, atol=1e-5 * max(scale, 1e-12), msg=k)


def test_images_reach_the_model(both_run, vl_assets, tmp_path):
    """The pictures matter: the same run with every image replaced by a blank one has other losses
    (lr 0, one step each, so only the inputs differ)."""
    from PIL import Image

    blank = tmp_path / "data"
    blank.mkdir()
    (blank / "dataset_info.json").write_text((vl_assets / "data" / "dataset_info.json").read_text())
    (blank / "kt_demo_vl.json").write_text((vl_assets / "data" / "kt_demo_vl.json").read_text())
    (blank / "images").mkdir()
    for p in (vl_assets / "data" / "images").iterdir():
        Image.new("RGB", (64, 64), (255, 255, 255)).save(blank / "images" / p.name)
    common = dict(learning_rate=0.0, max_steps=1, save_steps=10)
    real = step_losses(train(vl_assets, tmp_path / "real", **common))[1]
    white = step_losses(train(vl_assets, tmp_path / "white", dataset_dir=str(blank), **common))[1]
    assert abs(real - white) > 1e-4, (real, white)


@pytest.mark.parametrize(
    "scope, flags, want",
    [
        ("text", dict(), {"language", "experts"}),
        # `all` with the projector unfrozen but the vision tower frozen: still no LoRA on the projector
        ("text, projector unfrozen", dict(freeze_multi_modal_projector=False), {"language", "experts"}),
        ("vision", dict(freeze_vision_tower=False, freeze_language_model=True), {"vision"}),
        (
            "projector named",
            dict(
                freeze_multi_modal_projector=False, lora_target="q_proj,merger.linear_fc1,merger.linear_fc2"
            ),
            {"language", "experts", "projector"},
        ),
    ],
)
def test_scopes_change_exactly_their_groups(vl_assets, tmp_path, scope, flags, want):
    """Each scope (LLaMA-Factory's own flags) changes exactly its parameter groups."""
    run = train(vl_assets, tmp_path / "out", **flags)
    assert changed_groups(run) == want, scope
    if scope == "vision":  # expert LoRA saved, but never trained: B still zero
        fused = load_file(str(run / "fused_expert_lora.safetensors"))
        assert all(not v.any() for k, v in fused.items() if k.endswith("_b"))
        assert not lora_groups(run)["language"]


def test_both_scope_leaves_the_projector_out(both_run):
    """Vision tower and language model: every group but the projector changes; `lora_target: all`
    put no LoRA on the projector."""
    assert changed_groups(both_run) == {"vision", "language", "experts"}
    assert not lora_groups(both_run)["projector"]


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_lr0_losses_match_use_kt_false(family, request, tmp_path):
    """With images, use_kt true and false give the same losses (lr 0: the same model every step),
    rel 1e-5 (fp32); Qwen3-VL-MoE and the multimodal Qwen3.5-MoE."""
    assets = request.getfixturevalue("vl_assets" if family == "qwen3_vl_moe" else "vl35_assets")
    common = dict(
        learning_rate=0.0,
        max_steps=2,
        save_steps=10,
        freeze_vision_tower=False,
        template=VL_DEMOS[family].template,
    )
    kt = step_losses(train(assets, tmp_path / "kt", **common))
    hf = step_losses(train(assets, tmp_path / "hf", use_kt=False, **common))
    assert sorted(kt) == sorted(hf) == [1, 2]
    for s in kt:
        assert abs(kt[s] - hf[s]) <= LOSS_RTOL * abs(hf[s]), (s, kt[s], hf[s])


def test_resume_continues_the_same_run(both_run, vl_assets, tmp_path):
    """Resuming from checkpoint-2 gives steps 3-4 of the uninterrupted run and its adapter."""
    out = train(
        vl_assets,
        tmp_path / "resumed",
        freeze_vision_tower=False,
        resume_from_checkpoint=str(both_run / "checkpoint-2"),
    )
    want, got = step_losses(both_run), step_losses(out)
    for s in (3, 4):
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (s, got[s], want[s])
    a, b = lora_groups(out), lora_groups(both_run)
    for g in GROUPS:
        assert a[g].keys() == b[g].keys()
        for k in a[g]:
            torch.testing.assert_close(a[g][k], b[g][k], rtol=1e-4, atol=1e-6)


def test_qwen3_5_moe_trains_with_images_and_scopes(vl35_assets, tmp_path):
    """The multimodal Qwen3.5-MoE: with images, vision + language LoRA and the expert LoRA train,
    the projector (model.visual.merger) gets none, its experts go through the CPU op."""
    run = train(vl35_assets, tmp_path / "out", template="qwen3_5_nothink", freeze_vision_tower=False)
    assert changed_groups(run) == {"vision", "language", "experts"}
    assert not lora_groups(run)["projector"]
    manifest = json.loads((run / "kt_adapter_manifest.json").read_text())["experts"]
    assert manifest["targets"] == [f"model.language_model.layers.{i}.mlp.experts" for i in range(2)]


def test_real_model_recipe_is_consistent():
    """recipes/qwen3_vl_30b_a3b.yaml: kt keys validate, the family's built-in rule places the
    Qwen3-VL-MoE experts on the CPU, the template exists in LLaMA-Factory, bf16 LoRA."""
    import yaml
    from llamafactory.data.template import TEMPLATES
    from transformers import AutoConfig

    from kt_ft.plan.builtin import resolve_rule_path
    from kt_ft.plan.family import family_of
    from kt_ft.plan.loader import load_rules
    from kt_ft.plan.recipe import KTArguments
    from kt_ft.plan.tiny import tiny_config

    repo = Path(__file__).resolve().parents[1]
    family = family_of(tiny_config("qwen3_vl_moe"))
    assert isinstance(AutoConfig.for_model("qwen3_vl_moe"), type(tiny_config("qwen3_vl_moe")))
    r = yaml.safe_load((repo / "recipes" / family.recipe).read_text())
    KTArguments(**{k: r[k] for k in ("use_kt", "kt_optimize_rule", "cpu_infer", "chunk_size", "kt_backend")})
    assert r["kt_optimize_rule"] == family.builtin_rule == "qwen3_vl_moe"
    rules = load_rules(resolve_rule_path(family.builtin_rule))
    assert any("Qwen3VLMoeTextExperts" in rule.classes and rule.device == "cpu" for rule in rules.rules)
    assert r["template"] in TEMPLATES and family.template in TEMPLATES
    assert r["use_kt"] is True and r["bf16"] is True and r["finetuning_type"] == "lora"
    demo = yaml.safe_load((repo / "recipes" / "demo_tiny_qwen3vl_moe.yaml").read_text())
    assert demo["template"] == VL_DEMOS["qwen3_vl_moe"].template and demo["dataset"] == "kt_demo_vl"


# --------------------------------------------------------------------------- bad input


def test_image_dataset_on_a_text_only_model_is_refused(vl_assets, tmp_path):
    from kt_ft.base.errors import KTConfigError
    from kt_ft.integrations.demo.text import make_demo_model

    text = make_demo_model(tmp_path / "text")
    with pytest.raises(
        KTConfigError, match=r"dataset=kt_demo_vl has media columns \[kt_demo_vl \(images\)\]"
    ):
        train(vl_assets, tmp_path / "out", model_name_or_path=str(text / "model"), template="qwen")
    assert not (tmp_path / "out").exists()


def test_a_scope_that_freezes_everything_is_refused(vl_assets, tmp_path):
    from kt_ft.base.errors import KTConfigError

    with pytest.raises(KTConfigError, match="freeze_language_model=true") as err:
        train(vl_assets, tmp_path / "out", freeze_language_model=True)
    assert "freeze_vision_tower=true" in str(err.value)


# --------------------------------------------------------------------------- export and inference


def image_inputs(assets: Path) -> dict[str, torch.Tensor]:
    """The processor's tensors for one demo picture and a question (what LLaMA-Factory feeds)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(assets / "model")
    image = Image.open(assets / "data" / "images" / "000.png").convert("RGB")
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the picture?<|im_end|>\n"
    return dict(processor(images=[image], text=[text], return_tensors="pt"))


def lf_infer_model(assets: Path, adapter: Path):
    """LLaMA-Factory's inference load (as `llamafactory-cli chat`) of the base with ``adapter``, use_kt."""
    from llamafactory.hparams import get_infer_args
    from llamafactory.model import load_model, load_tokenizer

    model_args, _, finetuning_args, _ = get_infer_args(
        dict(
            model_name_or_path=str(assets / "model"),
            adapter_name_or_path=str(adapter),
            template="qwen3_vl_nothink",
            finetuning_type="lora",
            use_kt=True,
            cpu_infer=1,
            kt_backend="torch",
        )
    )
    tokenizer = load_tokenizer(model_args)["tokenizer"]
    return load_model(tokenizer, model_args, finetuning_args, is_trainable=False)


def logits_of(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits.float()


def hub_layout_copy(model_dir: Path, out: Path) -> Path:
    """A copy of ``model_dir`` whose fused experts are stored as the Qwen3-VL-MoE hub files store
    them: gate_up_proj [E, H, 2I], down_proj [E, I, H] (transposed)."""
    import shutil

    shutil.copytree(model_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    for k in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[k] = tensors[k].transpose(1, 2).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_merge_gives_the_trained_models_logits_with_images(both_run, vl_assets, tmp_path):
    """`kt-ft merge` of the VL adapter (vision LoRA, language LoRA, expert LoRA under
    model.language_model): the merged plain transformers model gives, on a picture, the logits of
    LLaMA-Factory's base + adapter with use_kt (fp32, rtol/atol 1e-5); merged into a base in the hub's
    transposed expert layout, the same model."""
    from transformers import AutoModelForImageTextToText

    from kt_ft.integrations.cli.main import main

    inputs = image_inputs(vl_assets)
    want = logits_of(lf_infer_model(vl_assets, both_run), inputs)
    base = logits_of(AutoModelForImageTextToText.from_pretrained(vl_assets / "model").eval(), inputs)
    assert (want - base).abs().max() > 1e-3, "the adapter changes nothing: the comparison would be void"

    assert main(["merge", str(both_run), str(tmp_path / "merged")]) == 0
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(logits_of(merged, inputs), want, rtol=1e-5, atol=1e-5)

    hub = hub_layout_copy(vl_assets / "model", tmp_path / "hub_base")
    assert main(["merge", str(both_run), str(tmp_path / "merged_hub"), "--base", str(hub)]) == 0
    t = "model.language_model.layers.1.mlp.experts.down_proj"
    assert load_file(str(tmp_path / "merged_hub" / "model.safetensors"))[t].shape == (8, 48, 64)
    merged_hub = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "merged_hub", dtype=torch.float32
    ).eval()
    torch.testing.assert_close(logits_of(merged_hub, inputs), want, rtol=1e-5, atol=1e-5)


def test_hub_layout_experts_are_read_straight_from_the_files(vl_assets, tmp_path):
    """A checkpoint storing the experts as the Qwen3-VL-MoE hub files do (transposed) is read by
    kt-ft itself into the same tensors transformers loads from the untransposed file (exact)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from kt_ft.runtime.loading import install_dispatch_guard, plan_expert_reader

    hub = hub_layout_copy(vl_assets / "model", tmp_path / "hub")
    names = [f"model.language_model.layers.{i}.mlp.experts" for i in range(2)]
    reader = plan_expert_reader(hub, AutoConfig.from_pretrained(hub), names)
    assert reader is not None and {s.layout for s in reader.sources} == {"fused_transposed"}
    install_dispatch_guard()
    model = AutoModelForImageTextToText.from_pretrained(hub, device_map=reader.device_map({"": "cpu"}))
    assert model.get_submodule(names[0]).down_proj.device.type == "meta"
    reader.fill(model)
    ref = AutoModelForImageTextToText.from_pretrained(vl_assets / "model")
    for n in names:
        for p in ("gate_up_proj", "down_proj"):
            want = getattr(ref.get_submodule(n), p)
            assert torch.equal(getattr(model.get_submodule(n), p), want), (n, p)


def test_convert_writes_per_expert_keys_under_the_language_model(both_run, tmp_path):
    """`kt-ft convert`: expert e of layer L is model.language_model.layers.L.mlp.experts.e.*_proj,
    A / B the slices of the fp32 expert LoRA; the vision and language PEFT keys are copied."""
    from kt_ft.integrations.cli.main import main

    assert main(["convert", str(both_run), str(tmp_path / "conv")]) == 0
    got = load_file(str(tmp_path / "conv" / "adapter_model.safetensors"))
    fused = load_file(str(both_run / "kt_expert_lora_master.safetensors"))
    peft = load_file(str(both_run / "adapter_model.safetensors"))
    experts = {k for k in got if ".mlp.experts." in k}
    assert len(experts) == 2 * 8 * 3 * 2
    prefix = "base_model.model.model.language_model.layers"
    for layer in (0, 1):
        for e in (0, 7):
            key = f"{prefix}.{layer}.mlp.experts.{e}.down_proj.lora_B.weight"
            assert torch.equal(got[key], fused[f"layers.{layer}.experts.down_lora_b"][e])
    assert {k: v for k, v in got.items() if k not in experts}.keys() == peft.keys()
    assert any(".visual.blocks." in k for k in peft)


def test_chunked_loss_of_a_vision_language_model_with_its_aux_loss(vl_assets):
    """The chunked loss (kt_ft/backends/lm_loss.py) on the Qwen3-VL-MoE composite, its router's
    auxiliary loss on (its weight lives in the text config): loss and every gradient as the model's
    own forward (fp32: rel 1e-5, 1e-5 of the largest gradient), text-only input."""
    import copy

    from helpers.lm_loss import apply_both
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    import kt_ft

    config = AutoConfig.from_pretrained(vl_assets / "model")
    config.text_config.output_router_logits = True
    config.text_config.router_aux_loss_coef = 0.05
    torch.manual_seed(0)
    base = get_peft_model(
        AutoModelForImageTextToText.from_config(config, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    twin = copy.deepcopy(base)
    apply_both(base, twin, kt_ft.KTConfig(rank=4, alpha=8, threads=1, seed=1))
    ids = torch.randint(10, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for m in (base, twin):
        m.train()
        out = m(input_ids=ids, labels=ids, output_router_logits=True)
        assert out.aux_loss is not None
        out.loss.backward()
        outs.append(out.loss.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=0)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[1].items():
        torch.testing.assert_close(grads[0][n], g, rtol=0, atol=1e-5 * g.abs().max().item() + 1e-12, msg=n)
