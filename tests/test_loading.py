"""Loading follows the plan: routed experts straight into CPU RAM, the rest straight to the GPU.

Peak RSS is measured in a fresh subprocess (VmHWM after resetting it with /proc/self/clear_refs,
after a warm-up load of a tiny model so imports and lazy initialisations are not counted).
safetensors files are memory-mapped: the pages read through the mapping count in RSS as
RssFile (page cache, shared and reclaimable) while the file is mapped; the private copy is
RssAnon. Tolerances: the private (anonymous) growth is at most 1.35 x the bytes that belong in
RAM + 24 MiB (allocator and loader overhead); the peak is at most that private growth + the file
pages (i.e. no transient extra copy) + 16 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import tiny_model

from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.runtime.loading import KTDeviceMap, device_map_from_plan, install_dispatch_guard

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

PROBE = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024

big, small = sys.argv[1], sys.argv[2]
AutoModelForCausalLM.from_pretrained(small, dtype="auto", device_map={"": "cpu"})  # warm-up
from kt_ft.plan.family import FAMILIES
from kt_ft.runtime.loading import load_planned, planned_device_map
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.loader import load_rules
from transformers import AutoConfig

config = AutoConfig.from_pretrained(big)
device = "cuda:0" if torch.cuda.is_available() else "cpu"
rules = load_rules(resolve_rule_path("qwen3_moe"))
device_map, plan = planned_device_map(config, rules, FAMILIES["qwen3_moe"], "auto", 1, device)
Path("/proc/self/clear_refs").write_text("5")
rss0, anon0, file0 = status("VmRSS:"), status("RssAnon:"), status("RssFile:")
model = load_planned(big, device_map, plan, dtype="auto")  # routed experts read by kt-ft
experts = {e.name for e in plan.experts}
where = {n: str(p.device) for n, p in model.named_parameters()}
print(json.dumps({
    "peak": status("VmHWM:") - rss0,
    "anon": status("RssAnon:") - anon0,
    "file": status("RssFile:") - file0,
    "expert_bytes": sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.rpartition(".")[0] in experts),
    "other_bytes": sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.rpartition(".")[0] not in experts),
    "expert_devices": sorted({d for n, d in where.items() if n.rpartition(".")[0] in experts}),
    "other_devices": sorted({d for n, d in where.items() if n.rpartition(".")[0] not in experts}),
    "gpu_peak": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
    "hf_device_map": hasattr(model, "hf_device_map"),
    "hooks": any(hasattr(m, "_hf_hook") for m in model.modules()),
}))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    # ~49 MiB fp32, 96% of it routed experts (2 layers x 32 experts of H 256, I 256)
    tiny_model(hidden_size=256, moe_intermediate_size=256, num_experts=32).save_pretrained(root / "big")
    tiny_model().save_pretrained(root / "small")
    return root


def test_device_map_from_plan():
    plan = make_plan(
        tiny_model(), load_rules(resolve_rule_path("qwen3_moe")), FAMILIES["qwen3_moe"], "auto", 1
    )
    dm = device_map_from_plan(plan, "cuda:0")
    assert isinstance(dm, KTDeviceMap)
    assert dm == {"": "cuda:0", "model.layers.0.mlp.experts": "cpu", "model.layers.1.mlp.experts": "cpu"}


def test_dispatch_is_skipped_only_for_kt_device_maps(monkeypatch):
    from transformers import modeling_utils

    calls = []
    monkeypatch.setattr(modeling_utils, "accelerate_dispatch", lambda *a, **k: calls.append(a[2]))
    install_dispatch_guard()
    install_dispatch_guard()  # idempotent
    modeling_utils.accelerate_dispatch(None, None, KTDeviceMap({"": 0, "x": "cpu"}), None, None, False)
    assert calls == []
    modeling_utils.accelerate_dispatch(None, None, {"": 0, "x": "cpu"}, None, None, False)
    assert calls == [{"": 0, "x": "cpu"}]


def test_load_peak_rss_is_one_copy_of_what_stays_in_ram(checkpoints):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(checkpoints / "big"), str(checkpoints / "small")],
        capture_output=True, text=True, env=env, check=True,
    ).stdout  # fmt: skip
    r = json.loads(out.strip().splitlines()[-1])
    assert r["expert_devices"] == ["cpu"]
    assert not r["hf_device_map"] and not r["hooks"]  # no accelerate dispatch: a single-device model
    ckpt = (checkpoints / "big" / "model.safetensors").stat().st_size
    in_ram = r["expert_bytes"] if torch.cuda.is_available() else ckpt
    print(f"checkpoint {ckpt / MiB:.1f} MiB, meant for RAM {in_ram / MiB:.1f} MiB: peak RSS growth "
          f"{r['peak'] / MiB:.1f} MiB (private {r['anon'] / MiB:.1f}, file-backed {r['file'] / MiB:.1f})")  # fmt: skip
    assert r["anon"] <= 1.35 * in_ram + 24 * MiB
    assert r["peak"] <= r["anon"] + r["file"] + 16 * MiB
    if torch.cuda.is_available():
        assert r["other_devices"] == ["cuda:0"]
        # nothing of the experts went through the GPU
        assert r["gpu_peak"] < r["other_bytes"] + 8 * MiB < r["expert_bytes"]


def test_llamafactory_refuses_a_rule_before_reading_weights(demo_assets, tmp_path, monkeypatch):
    pytest.importorskip("llamafactory")
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer
    from transformers import AutoModelForCausalLM

    from kt_ft.base.errors import KTConfigError

    rule = tmp_path / "gpu.yaml"
    rule.write_text("- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, gpu_experts: 9}\n")  # of 8
    args = dict(
        model_name_or_path=str(demo_assets / "model"), stage="sft", do_train=True, finetuning_type="lora",
        lora_target="all", dataset_dir=str(demo_assets / "data"), dataset="kt_demo", template="qwen",
        output_dir=str(tmp_path / "out"), report_to="none", use_kt=True, cpu_infer=1, kt_optimize_rule=str(rule),
    )  # fmt: skip
    model_args, _, _, finetuning_args, _ = get_train_args(args)
    tokenizer = load_tokenizer(model_args)["tokenizer"]

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the rule was refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(
        KTConfigError, match=r"gpu.yaml:1: gpu_experts: count 9 > the 8 experts of model.layers.0.mlp.experts"
    ):
        load_model(tokenizer, model_args, finetuning_args, is_trainable=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streamed_experts_equal_transformers_loading_bitwise(family, tmp_path):
    """kt-ft's reading of the routed experts (per-expert, Mixtral w1/w3/w2 or fused keys, as
    ``save_pretrained`` writes each family) gives bitwise transformers' own tensors: fp32 files
    read as fp32 (byte copy) and as bf16 (one-expert buffer + cast). Every other tensor too. The
    experts' storage stays resizable (a backend with its own copy frees kt-ft's: test_host_copy.py)."""
    from transformers import AutoModelForCausalLM

    from kt_ft.runtime.loading import load_planned, plan_expert_reader, planned_device_map

    fam = FAMILIES[family]
    tiny_model(family).save_pretrained(tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, device_map={"": "cpu"})
        rules = load_rules(resolve_rule_path(fam.builtin_rule))
        dm, plan = planned_device_map(ref.config, rules, fam, "auto", 1, "cpu")
        assert plan_expert_reader(tmp_path, ref.config, [e.name for e in plan.experts]) is not None
        got = load_planned(tmp_path, dm, plan, dtype=dtype)
        want, have = dict(ref.named_parameters()), dict(got.named_parameters())
        assert want.keys() == have.keys()
        for name, p in want.items():
            assert have[name].device.type == "cpu" and have[name].dtype == p.dtype, name
            assert torch.equal(have[name], p), name
        for e in plan.experts:
            for p in got.get_submodule(e.name).parameters():
                assert p.untyped_storage().resizable(), e.name


def test_unreadable_expert_layout_falls_back_with_the_reason(tmp_path, caplog):
    """Quantized experts (gpt_oss's MXFP4 ``_blocks``/``_scales`` here) are left to transformers."""
    from safetensors.torch import save_file

    from kt_ft.formats.expert_files import find_expert_sources
    from kt_ft.formats.skeleton import meta_model

    model = tiny_model("gpt_oss")
    name = "model.layers.0.mlp.experts"
    save_file(
        {f"{name}.gate_up_proj_blocks": torch.zeros(8, 128, 2, 16, dtype=torch.uint8),
         f"{name}.gate_up_proj_scales": torch.zeros(8, 128, 2, dtype=torch.uint8)},
        tmp_path / "model.safetensors",
    )  # fmt: skip
    sources, reason = find_expert_sources(tmp_path, meta_model(model.config, torch.bfloat16), [name])
    assert sources == []
    assert f"{name} (['{name}.gate_up_proj_blocks', '{name}.gate_up_proj_scales']...)" in reason
    assert "not a layout kt-ft reads itself" in reason
