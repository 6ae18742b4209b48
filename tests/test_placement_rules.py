"""`placement: auto` in the rule language, `kt-ft rules plan` with it, and the rates cache.

Tiny Qwen3-MoE (tests/helpers/tiny_models.py): H 64, 8 experts of I 32, top-2, 2 MoE layers, fp32 weights
(an expert: 3·64·32·4 = 24,576 bytes). The plan reads config.json and the safetensors header only.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.tiny_models import tiny_model

from kt_ft.backends.grouped_wide import wide_extra_bytes
from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.cli.main import main
from kt_ft.plan.cost import LayerShape, Rates
from kt_ft.plan.loader import load_rules
from kt_ft.runtime import measure

EXPERT_BYTES = 3 * 64 * 32 * 4
# one resident expert: its weights and, kept in the wide layout (kernels/grouped_wide.py), the
# rank-8 expert LoRA's blocks beside them
RESIDENT_BYTES = EXPERT_BYTES + wide_extra_bytes(64, 32, 8, 4)
AUTO_RULE = "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, backend: torch, placement: auto}\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("auto") / "fp32"
    tiny_model().save_pretrained(d)
    return d


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(measure.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def plan_json(capsys, rule, model_dir, *extra) -> tuple[int, dict]:
    rc = main(["rules", "plan", "--rule", str(rule), "--model", str(model_dir), "--json", *extra])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out else out.err


def test_placement_key_values_and_conflicts(tmp_path):
    rule = tmp_path / "r.yaml"
    rule.write_text(
        "- match: {class: Qwen3MoeExperts, layers: 0}\n  replace: {device: cpu, placement: fastest}\n"
        "- match: {class: Qwen3MoeExperts, layers: 1}\n  replace:\n    device: cpu\n    placement: auto\n"
        "    gpu_experts: 2\n"
    )
    with pytest.raises(KTConfigError) as e:
        load_rules(rule)
    msg = str(e.value)
    assert f"{rule}:2: [0].replace.placement: 'fastest'; valid choices: manual, auto" in msg
    assert f"{rule}:7: [1].replace.gpu_experts: given with placement: auto (at line 6)" in msg
    rule.write_text(AUTO_RULE)
    assert load_rules(rule).rules[0].placement == "auto"


def test_auto_big_cap_all_resident(model_dir, tmp_path, capsys):
    rule = tmp_path / "auto.yaml"
    rule.write_text(AUTO_RULE)
    rc, r = plan_json(
        capsys, rule, model_dir, "--rates", "cpu_token_us=90,link_gbps=55,gpu_tflops=400", "--gpu-mem", "2",
        "--cutoff-len", "64",
    )  # fmt: skip
    assert rc == 0
    p = r["placement"]
    assert p["groups"] == [
        {"layers": "0-1", "placement": "auto", "resident": 8, "streamed": 0, "cpu": 0,
         "cpu_s": 0.0, "link_s": 0.0, "gpu_s": p["groups"][0]["gpu_s"], "step_s": p["groups"][0]["gpu_s"]}
    ]  # fmt: skip
    assert p["predicted"]["bottleneck"] == "gpu" and p["predicted"]["resident_bytes"] == 16 * RESIDENT_BYTES
    # the budget is the cap minus the estimate of the rest of the GPU (the all-CPU plan's total)
    rc, plain = plan_json(capsys, "qwen3_moe", model_dir, "--cutoff-len", "64")
    assert p["budget_bytes"] == 2 * 2**30 - plain["devices"]["cuda:0"]["total_bytes"]
    # and the resident copies are counted on the GPU by the report
    assert (
        r["devices"]["cuda:0"]["param_bytes"]
        == plain["devices"]["cuda:0"]["param_bytes"] + 16 * RESIDENT_BYTES
    )
    assert (
        r["groups"][0]["how"]
        == "cpu torch 2 threads, placement auto, gpu_experts ids [0, 1, 2, 3, 4, 5, 6, 7]"
    )


def test_auto_planned_from_a_cpu_only_machine_counts_the_expert_lora_on_the_gpu(model_dir, tmp_path, capsys):
    """Planning a GPU run from a machine without CUDA (``--gpu-mem`` and ``--rates``): layers with
    GPU experts keep their expert LoRA and AdamW state on the GPU in that run unless the planner
    finds the step faster with it left on the CPU. A cap with room for every expert's weights but
    not for their layers' LoRA state as well: with the LoRA on the GPU fewer experts fit; left on
    the CPU (its crossings cost microseconds here, the CPU experts milliseconds) all do, the
    prediction pays for the crossings, and the report fits the cap either way."""
    rule = tmp_path / "auto.yaml"
    rule.write_text(AUTO_RULE)
    _, plain = plan_json(capsys, "qwen3_moe", model_dir, "--cutoff-len", "64")
    elt = EXPERT_BYTES // (3 * 64 * 32)
    act = LayerShape(8, 64, 32, 2, elt, elt).gpu_act_bytes(64 * 2)  # the reserve: a whole layer's pairs
    params = 3 * 8 * 8 * (64 + 32)  # a layer's expert LoRA (rank 8)
    # + the fp32 copies of both layers' LoRA that a LoRA left on the CPU puts on the GPU
    cap = plain["devices"]["cuda:0"]["total_bytes"] + 16 * RESIDENT_BYTES + act + 2 * 4 * params + 1024
    rc, r = plan_json(
        capsys, rule, model_dir, "--rates", "cpu_token_us=90,link_gbps=55,gpu_tflops=400",
        "--gpu-mem", f"{cap / 2**30:.12f}", "--cutoff-len", "64",
    )  # fmt: skip
    p = r["placement"]
    assert [(g["resident"], g["streamed"], g["cpu"]) for g in p["groups"]] == [(8, 0, 0)], p
    assert any("stays on the CPU" in n for n in p["notes"]), p["notes"]
    # 2 layers x 40 B a LoRA parameter at 7.4 GB/s (row copies both ways, a CPU AdamW: cost.py)
    host = 2 * 40 * params / 7.4e9
    assert p["predicted"]["step_s"] == pytest.approx(host + p["predicted"]["gpu_busy_s"], rel=1e-6)
    assert rc == 0 and r["devices"]["cuda:0"]["total_bytes"] <= cap, r["devices"]["cuda:0"]
    assert r["devices"]["cuda:0"]["lora_params"] == plain["devices"]["cuda:0"]["lora_params"]
    assert r["devices"]["cuda:0"]["param_bytes"] == plain["devices"]["cuda:0"]["param_bytes"] + (
        16 * RESIDENT_BYTES + 2 * 4 * params
    )


def test_auto_without_gpu_rates_keeps_everything_on_the_cpu(model_dir, tmp_path, capsys):
    rule = tmp_path / "auto.yaml"
    rule.write_text(AUTO_RULE)
    rc, r = plan_json(capsys, rule, model_dir, "--rates", "cpu_token_us=90", "--cutoff-len", "2048")
    assert rc == 0
    p = r["placement"]
    assert [(g["resident"], g["streamed"], g["cpu"]) for g in p["groups"]] == [(0, 0, 8)]
    assert p["predicted"]["cpu_busy_s"] == pytest.approx(2 * 2048 * 90e-6)  # 2 layers x 2048 tokens x 90 us
    assert p["predicted"]["bottleneck"] == "cpu"
    assert any("no link / GPU rate" in n for n in p["notes"])
    assert "cpu_token_us=90" in p["rates"][0]


def test_auto_with_gpu_rates_needs_a_cap_without_cuda(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rule = tmp_path / "auto.yaml"
    rule.write_text(AUTO_RULE)
    rc = main(["rules", "plan", "--rule", str(rule), "--model", str(model_dir), "--rates",
               "cpu_token_us=90,link_gbps=55,gpu_tflops=400"])  # fmt: skip
    assert rc == 2 and "give --gpu-mem GiB" in capsys.readouterr().err


def test_manual_rule_with_rates_prints_the_prediction(model_dir, capsys):
    rc = main(["rules", "plan", "--rule", "qwen3_moe", "--model", str(model_dir), "--rates", "cpu_pair_us=10",
               "--cutoff-len", "100"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    # 100 tokens x 2 slots x 10 us = 2 ms a layer, 4 ms for both
    assert "  0-1         manual             0        0     8     4.000" in out
    assert "bottleneck: cpu" in out


def test_rate_overrides_are_checked():
    assert measure.parse_overrides("cpu_token_us=90, link_gbps=55") == {
        "cpu_token_us": 90.0,
        "link_gbps": 55.0,
    }
    for bad, why in [
        ("cpu_token=90", "valid keys: cpu_token_us"),
        ("link_gbps=-1", "expected a positive number"),
        ("link_gbps=fast", "expected a positive number"),
        ("cpu_token_us=90,cpu_tflops=1", "give one of"),
    ]:
        with pytest.raises(KTConfigError, match=why):
            measure.parse_overrides(bad)
    shape = LayerShape(8, 100, 50, 2)
    r = measure.apply_overrides(Rates(None), {"cpu_token_us": 100, "link_gbps": 2, "gpu_tflops": 3}, shape, 0)
    assert r.cpu_flops == pytest.approx(2 * 60_000 / 100e-6)  # k pairs of 12·H·I FLOPs in 100 us
    assert (r.link_bytes_s, r.gpu_flops, r.expert_flops) == (2e9, 3e12, 3e12)


def test_cpu_rate_is_measured_once_and_cached(cache_dir, monkeypatch):
    shape = LayerShape(8, 64, 32, 2, 4, 4)
    calls = []

    def fake(*a, **k):
        calls.append(a)
        return 1.5e9

    monkeypatch.setattr(measure, "measure_cpu_flops", fake)
    r = measure.machine_rates(shape, "torch", 1, 64, cuda=False)
    assert r.cpu_flops == 1.5e9 and r.link_bytes_s is None and "measured" in r.source["cpu_flops"]
    r = measure.machine_rates(shape, "torch", 1, 64, cuda=False)
    assert r.cpu_flops == 1.5e9 and "cached" in r.source["cpu_flops"] and len(calls) == 1
    measure.machine_rates(shape, "torch", 1, 64, cuda=False, remeasure=True)
    assert len(calls) == 2
    measure.machine_rates(shape, "torch", 2, 64, cuda=False)  # other threads: another entry
    assert len(calls) == 3
    data = json.loads((cache_dir / "rates.json").read_text())
    (key,) = data
    assert key.endswith(f"| no GPU | torch {torch.__version__}") and len(data[key]["cpu_flops"]) == 2


def test_cpu_rate_measurement_runs_the_backend():
    """The real measurement on a tiny shape: a positive, finite rate (no speed asserted)."""
    f = measure.measure_cpu_flops(LayerShape(8, 64, 32, 2), "torch", 1, 64)
    assert 0 < f < float("inf")
