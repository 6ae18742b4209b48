"""Quantized-base helpers shared by the quantization tests (tests/test_quant.py, tests/test_mxfp4.py):
the Triton FP8 dequantizer's check (also run by a subprocess under Triton's interpreter), the
peak-RSS probe of loading a quantized checkpoint and the LLaMA-Factory adapter round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers.kt_adapters import lf_load
from kt_ft.backends import quant_reference as R
from kt_ft.backends.quant import FORMATS
from kt_ft.backends.quant_weights import QuantizedExperts
from kt_ft.integrations.cli.main import main as cli
from kt_ft.integrations.export.quantize import quantize_checkpoint
from kt_ft.plan.families import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
SEED = 0


def triton_fp8_case(device: str, on_gpu: bool) -> None:
    """The Triton FP8 kernel against the plain twin on ``device``: two experts (all 256 codes in the
    first), a shape with partial blocks, written into a row range of a larger buffer (the rows
    around it untouched), fp32 and bf16, bitwise. ``on_gpu`` False (Triton's interpreter, which
    turns e4m3 NaN codes into numbers and rounds to bf16 by truncation): the NaN codes are left out
    and bf16 is checked to within one bf16 step (2^-7 relative) of the float32 value. Returns
    nothing: a mismatch fails an assert naming the dtype."""
    from kt_ft.backends import dequant_triton

    f = FORMATS["fp8"]
    gen = torch.Generator().manual_seed(SEED)
    parts = [f.quantize((torch.randn(200, 300, generator=gen) * 0.02).bfloat16()) for _ in range(2)]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if not on_gpu:
        codes[(codes & 0x7F) == 0x7F] = 0
    parts[0]["weight"].view(torch.uint8).view(-1)[:256] = codes
    q = torch.stack([p["weight"] for p in parts]).to(device)
    s = torch.stack([p["weight_scale_inv"] for p in parts]).to(device)
    exact = torch.stack([R.dequantize("fp8", p) for p in parts])  # float32
    for dtype in (torch.float32, torch.bfloat16):
        want = exact.to(dtype)
        buf = torch.zeros(2, 210, 300, dtype=dtype, device=device)
        dequant_triton.dequant_fp8_block(q, s, buf[:, 7:207])
        got = buf[:, 7:207].cpu()
        assert not buf[:, :7].any() and not buf[:, 207:].any(), dtype
        assert torch.equal(got.isnan(), want.isnan()), dtype
        if on_gpu or dtype == torch.float32:
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), dtype
        else:
            assert ((got.float() - exact).abs() <= exact.abs() * 2**-7).all(), dtype


_PROBE = r"""
import json, sys, torch
from pathlib import Path
from transformers import AutoConfig
from kt_ft.plan.family import FAMILIES
from kt_ft.runtime import loading
from kt_ft.backends.quant_detect import take_quantization_config
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.loader import load_rules

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def load(d, family):
    config = AutoConfig.from_pretrained(d)
    take_quantization_config(config)
    rules = load_rules(resolve_rule_path(family))
    dm, plan = loading.planned_device_map(config, rules, FAMILIES[family], "torch", 1, "cpu")
    return loading.load_planned(d, dm, plan, dtype=torch.bfloat16), plan

load(sys.argv[2], sys.argv[3])  # warm-up: imports, allocator, code paths
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
rss0 = status("VmRSS:")
model, plan = load(sys.argv[1], sys.argv[3])
peak = status("VmHWM:") - rss0
experts = [getattr(model.get_submodule(e.name), n) for e in plan.experts for n in ("gate_up_proj", "down_proj")]
print(json.dumps({
    "peak": peak,
    "stored": sum(q.nbytes() for q in experts),
    "bf16": sum(q.dequantize_bytes() for q in experts),
    "other": sum(p.numel() * p.element_size() for p in model.parameters()),
    "kinds": sorted({type(q).__name__ for q in experts}),
}))
"""


def _random_checkpoint(out: Path, family: str = "deepseek_v3", **cfg) -> None:
    """A random bf16 model of ``family`` (transformers' save layout), built on meta then filled (fast)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fam = FAMILIES[family]
    config = AutoConfig.for_model(family, vocab_size=128, **{**fam.demo_config, **cfg})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05, generator=gen)
        for b in model.buffers():
            b.zero_()
    model.save_pretrained(out)


def assert_quantized_load_peak(tmp_path: Path, fmt: str, family: str, **cfg) -> None:
    """Quantize a random ``family`` model of ``cfg``'s shapes to ``fmt`` and load it in a fresh
    process (after a warm-up load of a small one): its experts are QuantizedExperts and the peak RSS
    growth stays below the experts' bf16 size and within 1.1 x their stored bytes + the rest + 48 MiB.
    Returns nothing (prints the sizes); ``tmp_path`` receives the checkpoints."""
    _random_checkpoint(tmp_path / "bf16", family, **cfg)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / fmt, fmt)
    _random_checkpoint(tmp_path / "wbf16", family)
    quantize_checkpoint(tmp_path / "wbf16", tmp_path / "warm", fmt)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / fmt), str(tmp_path / "warm"), family],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"experts {r['stored'] / MiB:.0f} MiB stored {fmt} ({r['bf16'] / MiB:.0f} MiB as bf16), rest "
        f"{r['other'] / MiB:.0f} MiB: peak RSS growth {r['peak'] / MiB:.0f} MiB"
    )
    assert r["kinds"] == ["QuantizedExperts"]
    assert r["peak"] < r["bf16"]
    assert r["peak"] <= 1.1 * r["stored"] + r["other"] + 48 * MiB


def assert_quantized_adapter_round_trip(assets: Path, fmt: str, tmp_path: Path, capsys) -> Path:
    """Through LLaMA-Factory: ``kt-ft quantize --format fmt`` of the demo in ``assets`` loads with
    its experts kept quantized, the saved manifest says ``experts.base_format: fmt``, merge onto it
    is refused with the reason and the options, and merge onto its ``kt-ft dequantize`` copy works;
    returns the merged model's directory."""
    q = tmp_path / fmt
    assert cli(["quantize", str(assets / "model"), str(q), "--format", fmt]) == 0
    model = lf_load(assets, True, model_dir=q, output_dir=str(tmp_path / "train"))
    experts = [m for m in model.modules() if type(m).__name__ == "KTExperts"]
    assert experts and all(isinstance(m.gate_up_proj, QuantizedExperts) for m in experts)
    model.save_pretrained(str(tmp_path / "adapter"))
    manifest = json.loads((tmp_path / "adapter" / "kt_adapter_manifest.json").read_text())
    assert manifest["experts"]["base_format"] == fmt
    capsys.readouterr()
    assert cli(["merge", str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert f"{fmt}-quantized" in err and "kt-ft dequantize" in err and "kt-ft convert" in err, err
    assert cli(["dequantize", str(q), str(tmp_path / "plain")]) == 0
    merged = tmp_path / "merged"
    assert cli(["merge", str(tmp_path / "adapter"), str(merged), "--base", str(tmp_path / "plain")]) == 0
    return merged
