"""`kt-ft bench --parts e2e` on the tiny preset: `llamafactory-cli train` once per system, measured from
outside. No speed is asserted; the runs must train, log their rate and agree on the first loss."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from kt_ft.integrations.bench.e2e_logs import last_half_rate, rate_from_log
from kt_ft.integrations.bench.e2e_systems import parse_systems


def test_rate_from_log_uses_lf_elapsed_time_and_skips_a_step():
    # elapsed = total_tokens / throughput: 1 s, 3 s, 4 s, 10 s for 100 tokens a step
    rows = [
        {"current_steps": 1, "total_tokens": 100, "throughput": 100.0},
        {"current_steps": 2, "total_tokens": 200, "throughput": 200 / 3},
        {"current_steps": 3, "total_tokens": 300, "throughput": 75.0},
        {"current_steps": 4, "total_tokens": 400, "throughput": 40.0},
    ]
    rate, steps, per_step = rate_from_log(rows)
    assert steps == pytest.approx([2.0, 1.0, 6.0]) and per_step == 100
    assert rate == pytest.approx(300 / 9)  # the first step's start-up stays out
    rate, _, _ = rate_from_log(rows, skip_step=4)
    assert rate == pytest.approx(200 / 3)
    assert rate_from_log(rows[:1]) == (None, [], None)
    assert last_half_rate(rows) == pytest.approx(200 / 7)  # steps 3 and 4 (1 s + 6 s)
    assert last_half_rate(rows[:3]) == pytest.approx(100 / 1)  # step 3 alone


def test_parse_systems_names_the_valid_forms():
    names = [s.name for s in parse_systems("peft, kt-cpu:torch,kt-auto@24,kt-auto,kt-stream")]
    assert names == ["peft", "kt-cpu:torch", "kt-auto@24", "kt-auto", "kt-stream"]
    assert parse_systems("kt-auto@12.5")[0].cap_gib == 12.5
    with pytest.raises(ValueError, match="'kt-fast' is not a system; valid: peft, kt-cpu:<backend>"):
        parse_systems("peft,kt-fast")
    # a kt-ft system on the model's `kt-ft quantize` copy
    (q,) = parse_systems("kt-auto@24+fp8")
    assert (q.name, q.kind, q.cap_gib, q.quant) == ("kt-auto@24+fp8", "auto", 24, "fp8")
    assert parse_systems("kt-cpu:torch+int8")[0].backend == "torch"
    for bad in ("peft+fp8", "kt-auto+gptq", "kt-peer+int8"):
        with pytest.raises(ValueError, match="takes one of fp8, int8, int4 after a kt-ft system"):
            parse_systems(bad)
    # a kt-ft system with one of kt-ft's settings for its run (two ways of one mechanism, one run)
    (g,) = parse_systems("kt-auto@24+fp8%KT_FT_CUDA_GRAPHS=0")
    assert (g.kind, g.cap_gib, g.quant, g.settings) == ("auto", 24, "fp8", (("KT_FT_CUDA_GRAPHS", "0"),))
    (two,) = parse_systems("kt-auto%KT_FT_FUSIONS=rope+loss%KT_FT_CUDA_GRAPHS=0")
    assert two.settings == (("KT_FT_FUSIONS", "rope+loss"), ("KT_FT_CUDA_GRAPHS", "0"))
    assert parse_systems("kt-cpu:torch%KT_FT_FUSIONS=none")[0].settings == (("KT_FT_FUSIONS", "none"),)
    with pytest.raises(ValueError, match=r"KT_FT_FUSIONS='rope\+fast': fast is not a fusion"):
        parse_systems("kt-auto%KT_FT_FUSIONS=rope+fast")
    for bad in (
        "kt-auto%KT_FT_NOPE=1",
        "kt-auto%KT_FT_FUSIONS=none%KT_FT_NOPE=1",
        "kt-auto%KT_FT_CUDA_GRAPHS",
        "peft%KT_FT_CUDA_GRAPHS=1",
    ):
        with pytest.raises(ValueError, match="suffix takes one of kt-ft's settings"):
            parse_systems(bad)


def test_the_peer_system_gets_llamafactorys_own_keys_and_needs_its_packages(tmp_path):
    """kt-peer: LLaMA-Factory's native use_kt with transformers-kt's ``kt_config`` and none of kt-ft's
    keys (LF would refuse them with kt-ft's hook off); without the directory of its packages the
    bench stops before building anything."""
    import yaml

    from kt_ft.integrations.bench.e2e import run_e2e
    from kt_ft.integrations.bench.e2e_systems import write_recipe

    (peer,) = parse_systems("kt-peer")
    assert peer.kind == "peer" and not peer.use_kt
    path = write_recipe(
        tmp_path, peer, model_dir=tmp_path / "m", data_dir=tmp_path / "d", preset="tiny", cutoff_len=64,
        steps=2, grad_accum=1, threads=12, bf16=True,
    )  # fmt: skip
    recipe = yaml.safe_load(path.read_text())
    assert recipe["use_kt"] is True
    assert recipe["kt_config"] == {"kt_backend": "AMXBF16", "kt_num_threads": 12}
    assert recipe["use_reentrant_gc"] is False  # kt-kernel's recompute policy refuses reentrant checkpointing
    assert not {"chunk_size", "kt_backend", "cpu_infer", "kt_optimize_rule", "kt_gpu_memory"} & set(recipe)
    with pytest.raises(ValueError, match="--peer-site None: kt-peer needs"):
        run_e2e(preset="tiny", layers=None, systems=[peer], workdir=tmp_path / "w", threads=2)
    assert not (tmp_path / "w").exists()


@pytest.mark.lf_subprocess
def test_e2e_tiny_trains_each_system_through_llamafactory(tmp_path):
    """peft and kt-ft (every expert on the CPU) through `llamafactory-cli train`: both finish, both
    rates come from LF's log, and the first-step losses agree (expert LoRA B starts at zero, so kt-ft's
    first forward is the plain model's; fp32 on the CPU: relative 1e-4). The first step is profiled
    (the rate, from the second, does not include it)."""
    out = tmp_path / "e2e.json"
    env = {**os.environ, "KT_FT_PROFILE": f"{tmp_path / 'prof'},step=1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kt_ft.integrations.cli.main", "bench", "--parts", "e2e", "--preset", "tiny", "--seq", "64",
         "--e2e-steps", "2", "--grad-accum", "1", "--threads", "1", "--cpu-infer", "1",
         "--e2e-systems", "peft,kt-cpu:torch,kt-auto,kt-cpu:torch+int8",
         "--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipping kt-auto: needs a CUDA GPU" in proc.stdout
    assert "llamafactory-cli train, tiny x2 layers, cutoff_len 64" in proc.stdout
    records = {r["system"]: r for r in json.loads(out.read_text())["records"]}
    assert set(records) == {"peft", "kt-cpu:torch", "kt-cpu:torch+int8"}, proc.stdout[-3000:]
    for r in records.values():
        assert r["rc"] == 0 and r["steps_logged"] == 2, r
        assert r["tokens_per_step"] == 64  # every example is longer than cutoff_len
        assert r["tok_s"] > 0 and len(r["step_s"]) == 1 and r["host_peak_bytes"] > 0
        assert len(r["losses"]) == 2 and r["losses"][0] == r["first_loss"]
        # the trainer's start line was seen: the host peak before it is known and within the run's
        assert 0 < r["host_peak_load_bytes"] <= r["host_peak_bytes"], r
        # KT_FT_RUN_REPORT's host-time line, read from the log: step 2 (step 1 was profiled); one thread's CPU
        # time cannot pass the wall time (clock ticks of 10 ms: that much slack)
        if sys.platform.startswith("linux"):
            assert r["host_step_ms"] > 0 and 0 <= r["host_main_ms"] <= r["host_step_ms"] + 10, r
        # kt-ft runs state their CPU op's time (the run summary line): an average over every
        # micro-batch, the first step's warm-up included, so its total is bounded by the run's wall
        # time (not by the later steps' rate, which leaves the first step out)
        if r["system"].startswith("kt-cpu"):
            assert 0 < r["cpu_op_micro_s"] * r["steps_logged"] * r["grad_accum"] < r["seconds"], r
    a, b = records["kt-cpu:torch"]["first_loss"], records["peft"]["first_loss"]
    assert abs(a - b) <= 1e-4 * abs(b), (a, b)
    # the same model with its routed experts in int8 (per-channel: ~0.4% of each weight) runs on the
    # `kt-ft quantize` copy, its experts kept int8: the first loss moves by the rounding only
    q = records["kt-cpu:torch+int8"]["first_loss"]
    assert q != a and abs(q - a) <= 1e-2 * abs(a), (q, a)
    work = tmp_path / "work"
    timeline = (work / "runs" / "kt-cpu-torch" / "host_memory.csv").read_text().splitlines()
    assert timeline[0] == "seconds,host_used_gib,phase" and len(timeline) >= 2, timeline
    recipe = yaml.safe_load((work / "runs" / "kt-cpu-torch+int8" / "recipe.yaml").read_text())
    assert recipe["model_name_or_path"] == str(work / "model-int8")
    assert json.loads((work / "model-int8" / "config.json").read_text())["quantization_config"]["format"] == (
        "int-quantized"
    )
    for name in ("peft", "kt-cpu-torch"):  # the profiled step's tables
        assert "## by self CPU time" in (tmp_path / "prof" / name / "step1.txt").read_text()
    # the recipe of each run stays beside its log, to rerun by hand
    assert (tmp_path / "work" / "runs" / "kt-cpu-torch" / "recipe.yaml").is_file()


def test_loss_agreement_compares_the_kt_ft_systems_step_by_step():
    """Against the first kt-ft system with losses; peft (another adapter) and failed runs left out."""
    from kt_ft.integrations.bench.e2e_report import loss_agreement
    from kt_ft.integrations.bench.e2e_run import E2ERecord

    def rec(system, losses):
        return E2ERecord(system=system, preset="tiny", layers=2, rc=0, seconds=1.0, losses=losses)

    records = [
        rec("peft", [9.0, 1.0]),
        rec("kt-auto", [5.0, 4.0, 3.0]),
        rec("kt-auto@24", [5.0, 4.004, 3.0]),
        rec("kt-cpu:torch", []),
        rec("kt-stream", [5.0, 4.0]),
    ]
    ref, worst, steps = loss_agreement(records)
    assert ref == "kt-auto" and steps == 3
    assert worst == pytest.approx(0.004 / 4.0)
    assert loss_agreement(records[:2]) is None


@pytest.mark.lf_subprocess
def test_e2e_tiny_vision_language_trains_with_pictures(tmp_path, capsys):
    """`--preset tiny-vl`: a Qwen3-VL-MoE with its processor and pictures paired with long texts,
    trained by kt-ft through `llamafactory-cli train` (its losses against use_kt: false with
    pictures: test_multimodal.py); the examples carry their pictures, the recipe the VL template."""
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kt_ft.integrations.cli.main", "bench", "--parts", "e2e", "--preset", "tiny-vl", "--seq", "128",
         "--e2e-steps", "2", "--grad-accum", "1", "--threads", "1", "--cpu-infer", "1",
         "--e2e-systems", "kt-cpu:torch", "--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["system"]: r for r in json.loads(out.read_text())["records"]}
    (r,) = records.values()
    assert r["system"] == "kt-cpu:torch" and r["rc"] == 0 and r["steps_logged"] == 2 and r["tok_s"] > 0, r
    assert all(math.isfinite(x) for x in r["losses"])
    work = tmp_path / "work"
    assert json.loads((work / "model" / "config.json").read_text())["model_type"] == "qwen3_vl_moe"
    rows = json.loads((work / "data" / "kt_e2e.json").read_text())
    assert all(
        (work / "data" / r["images"][0]).is_file() and "<image>" in r["messages"][0]["content"] for r in rows
    )
    recipe = (work / "runs" / "kt-cpu-torch" / "recipe.yaml").read_text()
    assert "template: qwen3_vl_nothink" in recipe
    # the rule of a GPU-placed system (those need CUDA to run): the family's, from the model's config
    from kt_ft.integrations.bench.e2e_systems import write_rule

    (system,) = parse_systems("kt-auto@24")
    rule = yaml.safe_load(write_rule(tmp_path, work / "model", system).read_text())
    assert rule[0] == {"include": "qwen3_vl_moe"} and rule[1]["replace"]["placement"] == "auto", rule
    assert rule[1]["match"] == {"class": "Qwen3VLMoeTextExperts"}, rule
    from kt_ft.integrations.cli.main import main

    assert main(["bench", "--parts", "op", "--preset", "tiny-vl"]) == 2  # a VL preset: the e2e part only
    assert "runs with --parts e2e only" in capsys.readouterr().err


def test_the_qwen3_vl_preset_builds_on_meta():
    """The full-size vision-language preset's config makes the model (on meta: no memory), its
    language model Qwen3-30B-A3B's shapes, its vision tower feeding the language model's width."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from kt_ft.integrations.bench.models import MODEL_CONFIGS
    from kt_ft.integrations.bench.vl_assets import VL_PRESETS

    text, vision, _ = VL_PRESETS["qwen3-vl-30b-a3b"]
    config = AutoConfig.for_model("qwen3_vl_moe", text_config={**text, "num_hidden_layers": 2},
                                  vision_config=dict(vision), tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    qwen3 = MODEL_CONFIGS["qwen3-30b-a3b"][1]
    experts = model.model.language_model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) in (
        (qwen3["num_experts"], 2 * qwen3["moe_intermediate_size"], qwen3["hidden_size"]),
        (qwen3["num_experts"], qwen3["hidden_size"], 2 * qwen3["moe_intermediate_size"]),
    )
    assert config.vision_config.out_hidden_size == qwen3["hidden_size"] and config.vision_config.depth == 27


def test_varied_lengths_span_a_quarter_of_cutoff_to_all_of_it(tmp_path):
    """``--e2e-lengths varied``: the examples' token counts (the trained tokenizer's) spread from
    about cutoff_len / 4 to past cutoff_len, and the data is rewritten when the choice changes."""
    from transformers import AutoTokenizer

    from kt_ft.integrations.bench.e2e_assets import DATASET, write_assets

    model_dir, data_dir, _ = write_assets(tmp_path, "tiny", None, 256, 24, lengths="varied")
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = json.loads((data_dir / f"{DATASET}.json").read_text())
    counts = sorted(len(tok(r["output"])["input_ids"]) for r in rows)
    print(counts)
    assert 48 <= counts[0] <= 128 and counts[-1] >= 200 and len(set(counts)) >= 12, counts
    with pytest.raises(ValueError, match="valid choices: cutoff, varied"):
        write_assets(tmp_path, "tiny", None, 256, 24, lengths="short")
    write_assets(tmp_path, "tiny", None, 256, 24)  # back to cutoff: rewritten, every example long
    rows = json.loads((data_dir / f"{DATASET}.json").read_text())
    assert min(len(tok(r["output"])["input_ids"]) for r in rows) > 256


def test_rounds_alternate_the_order_and_pair_each_run_with_its_rounds_peft(tmp_path, monkeypatch, capsys):
    """``--e2e-rounds 3``: the systems run A B, B A, A B (each run in its own ``-r<N>`` directory),
    each record knows its round, every row's ratio is to the peft run of its round, and the table
    ends with each system's median over the rounds and the ratio of the medians. The runs are stubbed
    (what a run measures is the other tests'): tokens/s grow with the run's position, as a drifting
    host's can, and kt-cpu:torch is 0.9x what peft would get in the same position."""
    from kt_ft.integrations.bench import e2e
    from kt_ft.integrations.bench.e2e_run import E2ERecord

    calls = []

    def fake_run(system, recipe, run_dir, **kw):
        calls.append((system.name, run_dir.name))
        drift = 1000.0 * (1 + len(calls))  # later runs faster
        rate = drift if system.name == "peft" else 0.9 * drift
        return E2ERecord(system.name, "tiny", 2, 0, 1.0, tok_s=rate, gpu_peak_bytes=None)

    monkeypatch.setattr(e2e, "write_assets", lambda *a: (tmp_path / "m", tmp_path / "d", 2))
    monkeypatch.setattr(e2e, "write_recipe", lambda run_dir, *a, **k: run_dir / "recipe.yaml")
    monkeypatch.setattr(e2e, "run_system", fake_run)
    systems = parse_systems("peft,kt-cpu:torch")
    recs = e2e.run_e2e(preset="tiny", layers=None, systems=systems, workdir=tmp_path, threads=1, rounds=3)
    assert calls == [
        ("peft", "peft-r1"), ("kt-cpu:torch", "kt-cpu-torch-r1"),
        ("kt-cpu:torch", "kt-cpu-torch-r2"), ("peft", "peft-r2"),
        ("peft", "peft-r3"), ("kt-cpu:torch", "kt-cpu-torch-r3"),
    ]  # fmt: skip
    assert [r.round for r in recs] == [1, 1, 2, 2, 3, 3]
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("kt-cpu:torch ")]
    # against the peft run of its own round: the run after peft's gains from the drift (0.9 x
    # 3,000 / 2,000 and 0.9 x 7,000 / 6,000), the run before it loses (0.9 x 4,000 / 5,000)
    assert [row[2] for row in rows] == ["2,700", "3,600", "6,300"], out
    assert [row[3] for row in rows] == ["1.35", "0.72", "1.05"], out
    # medians: peft 2,000 / 5,000 / 6,000 -> 5,000; kt 2,700 / 3,600 / 6,300 -> 3,600: 0.72x
    assert "3,600 tok/s (2,700-6,300, 3 runs), 0.72x peft's median" in out, out
    with pytest.raises(ValueError, match="--e2e-rounds 0"):
        e2e.run_e2e(preset="tiny", layers=None, systems=systems, workdir=tmp_path, threads=1, rounds=0)


def test_monitor_reads_memory_and_utilization_from_nvidia_smi_lines():
    """``nvidia-smi --query-gpu=memory.used,utilization.gpu`` lines: the peak in bytes, the mean
    utilization over the samples taken while training (a line it cannot read is skipped)."""
    from types import SimpleNamespace

    from kt_ft.integrations.bench.e2e_monitor import Monitor

    mon = Monitor(None)
    mon._smi = SimpleNamespace(stdout=iter(["1000, 5\n"]))
    mon._read_smi()  # before training: counts for the peak, not for the utilization
    assert mon.gpu_peak == 1000 * 2**20 and mon.gpu_util is None
    mon.training = True
    mon._smi = SimpleNamespace(stdout=iter(["1500, 50\n", "[N/A], 7\n", "1200, 100\n"]))
    mon._read_smi()
    assert mon.gpu_peak == 1500 * 2**20 and mon.gpu_util == 75.0


def test_link_bound_from_a_streaming_runs_log(capsys):
    """The run summary's streamed bytes over the run's steps at the planned link rate: the tokens/s
    no schedule of that split beats (a Qwen3-30B-A3B run at 24 GiB: 434.67 GiB in 5 steps at
    54.7 GB/s, 8,192 tokens a step); none where nothing streamed or no rate was logged."""
    from kt_ft.integrations.bench.e2e_logs import link_bound

    log = (
        "    link 54.7 GB/s [cached (/root/.cache/kt-ft/rates.json)]\n"
        "  predicted step 499.590 ms, 4,099 tokens/s: busy CPU 0.000 ms, link 425.976 ms, GPU 147.228 ms\n"
        "[kt-ft|INFO] run summary: streamed 434.67 GiB in 402 copies (80.4 a step; forward 12, prefetch 390), ...\n"
    )
    per_step_s = 434.67 * 2**30 / 5 / 54.7e9
    assert link_bound(log, 5, 8192) == pytest.approx(8192 / per_step_s)
    assert 4_700 < link_bound(log, 5, 8192) < 4_900
    mib = log.replace("434.67 GiB", "512.00 MiB")
    assert link_bound(mib, 5, 8192) == pytest.approx(8192 / (512 * 2**20 / 5 / 54.7e9))
    assert link_bound(log.replace("run summary: streamed", "run summary: GPU allocator"), 5, 8192) is None
    assert link_bound(log.replace("GB/s", "GiB"), 5, 8192) is None
    assert link_bound(log, 0, 8192) is None
    from kt_ft.integrations.bench.e2e_report import print_table
    from kt_ft.integrations.bench.e2e_run import E2ERecord

    run = E2ERecord("kt-auto@24", "qwen3-30b-a3b", 24, 0, 70.0, tok_s=4_329.0, link_bound_tok_s=4_800.0)
    print_table([run], 2048, 4)
    assert "kt-auto@24                     4,800 tok/s, 90% reached" in capsys.readouterr().out
