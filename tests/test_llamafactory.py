"""LLaMA-Factory integration in-process: recipe keys, validation, fork path off, model loading."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.lf_recipe import recipe

from kt_ft.base.errors import KTConfigError
from kt_ft.runtime.experts import KTExperts

pytest.importorskip("llamafactory")


def test_hook_is_installed_without_importing_torch():
    code = (
        "import sys; from kt_ft.integrations.startup import PostImportFinder;"
        "assert any(isinstance(f, PostImportFinder) for f in sys.meta_path), 'hook missing';"
        "assert 'torch' not in sys.modules and 'llamafactory' not in sys.modules, 'start-up imported heavy modules'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_values_are_reported_together_before_loading(demo_assets, tmp_path):
    from llamafactory.hparams import get_train_args

    with pytest.raises(KTConfigError) as info:
        get_train_args(
            recipe(demo_assets, tmp_path, cpu_infer=-2, kt_backend="fastest", kt_optimize_rule="nope.yaml")
        )
    msg = str(info.value)
    assert "cpu_infer=-2" in msg and "positive integer" in msg
    assert "kt_backend='fastest'" in msg and "auto, torch, torch-ep, native, reference, kt-kernel" in msg
    assert "kt_optimize_rule='nope.yaml'" in msg and "qwen3_moe" in msg  # lists the built-in rules
    assert len(info.value.problems) == 3


def test_fork_only_keys_are_refused(demo_assets, tmp_path):
    from llamafactory.hparams import get_train_args

    with pytest.raises(KTConfigError, match="kt_weight_path"):
        get_train_args(recipe(demo_assets, tmp_path, kt_weight_path="/x"))


def test_kt_args_parse_and_fork_path_stays_off(demo_assets, tmp_path, monkeypatch):
    from llamafactory.hparams import get_train_args

    for k in list(os.environ):
        if k.startswith("ACCELERATE_KT_"):
            monkeypatch.delenv(k)
    # LLaMA-Factory's own use_kt would demand transformers-kt / accelerate-kt here and export ACCELERATE_KT_*.
    model_args, *_ = get_train_args(recipe(demo_assets, tmp_path, chunk_size=128, kt_backend="torch"))
    assert model_args.use_kt is True
    assert (model_args.cpu_infer, model_args.chunk_size, model_args.kt_backend) == (1, 128, "torch")
    assert not [k for k in os.environ if k.startswith("ACCELERATE_KT_")]


def test_help_lists_kt_keys():
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "llamafactory-cli"), "train", "-h"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    for key in ("--use_kt", "--kt_optimize_rule", "--cpu_infer", "--chunk_size", "--kt_backend"):
        assert key in out, key
    assert "CPU threads for the routed-expert operator" in out


def _load(demo_assets, tmp_path, **overrides):
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer

    model_args, _, _, finetuning_args, _ = get_train_args(recipe(demo_assets, tmp_path, **overrides))
    tokenizer = load_tokenizer(model_args)["tokenizer"]
    return load_model(tokenizer, model_args, finetuning_args, is_trainable=True)


def test_use_kt_false_leaves_llamafactory_untouched(demo_assets, tmp_path):
    model = _load(demo_assets, tmp_path, use_kt=False)
    assert not any(isinstance(m, KTExperts) for m in model.modules())
    assert any(type(m).__name__ == "Qwen3MoeExperts" for m in model.modules())


def test_use_kt_replaces_experts_and_pins_them_to_cpu(demo_assets, tmp_path):
    model = _load(demo_assets, tmp_path)
    kt = [m for m in model.modules() if isinstance(m, KTExperts)]
    assert [m.layer_idx for m in kt] == [0, 1]
    assert all(p.requires_grad for m in kt for p in m.lora_tensors())
    assert not any(m.gate_up_proj.requires_grad or m.down_proj.requires_grad for m in kt)
    # PEFT LoRA on attention trains too
    assert any("q_proj.lora_A" in n and p.requires_grad for n, p in model.named_parameters())
    # a whole-model move (what the Trainer does with the GPU) skips the routed experts
    model.to(torch.float64)
    assert kt[0].gate_up_proj.dtype == torch.float32 and kt[0].gate_a.dtype == torch.float32
    assert next(model.get_base_model().model.embed_tokens.parameters()).dtype == torch.float64
    model.to("meta")
    assert kt[0].gate_up_proj.device.type == "cpu" and kt[0].gate_a.device.type == "cpu"


def test_rule_matching_nothing_is_an_error(demo_assets, tmp_path):
    rule = tmp_path / "rule.yaml"
    rule.write_text(
        "- match:\n    class: Qwen3MoeExperts\n  replace:\n    device: cpu\n"
        "- match:\n    name: 'no_such_module'\n  replace:\n    device: cuda\n"
    )
    with pytest.raises(KTConfigError, match=r"rule.yaml:5: rule #2 .* matches no module"):
        _load(demo_assets, tmp_path, kt_optimize_rule=str(rule))
