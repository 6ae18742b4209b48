"""Quantized base weights (``kt_ft/quant``): formats, loading, compute, CLI, checkpoints, plans.

Every check compares against something computed another way: the vectorised dequantizers
against the plain twins of ``kt_ft/backends/quant_reference.py`` (and a hand-packed int4 word), the
quantized model's loss and gradients against the same model dequantized to fp32 and run by the
pure-torch reference backend, the plan's bytes against the formula from the config, peak RSS
against the experts' bf16 size.

Tolerances: dequantizers bitwise (both compute q * s in fp32, one rounding); training parity in
fp32: loss rel 1e-6, every gradient within 1e-5 of its largest entry (the torch backend sums in
another order than the reference loop; measured ~1e-6). Seeds are printed.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.quant import (
    SEED,
    MiB,
    assert_quantized_adapter_round_trip,
    assert_quantized_load_peak,
    triton_fp8_case,
)
from helpers.tiny_models import tiny_model
from safetensors import safe_open
from safetensors.torch import save_file

from kt_ft.backends import native
from kt_ft.backends import quant_reference as R
from kt_ft.backends.quant import FORMATS, pack_int4
from kt_ft.backends.quant_detect import detect_format, take_quantization_config
from kt_ft.backends.quant_weights import QuantizedExperts
from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.cli.main import main as cli
from kt_ft.integrations.export.quantize import dequantize_checkpoint, quantize_checkpoint
from kt_ft.plan.families import FAMILIES

# the formats of DeepSeek-V3-layout checkpoints (mxfp4 is gpt-oss's fused layout: tests/test_mxfp4.py)
PER_EXPERT_FORMATS = ("fp8", "int4", "int8")


# --- formats --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_matches_the_plain_twin(fmt):
    """Vectorised dequantize == the loop-over-blocks/groups/nibbles twin, bitwise; stored tensors
    have the shapes and dtypes the format declares; the error against the original weight is
    what the format allows (fp8 e4m3: 3 mantissa bits; int4: 16 levels; int8: 255; mxfp4: fp4
    values, power-of-two scales). mxfp4 stores whole groups of 32 inputs only (no shape)."""
    f = FORMATS[fmt]
    gen = torch.Generator().manual_seed(SEED)
    bound = {"fp8": 0.04, "int4": 0.12, "int8": 0.01, "mxfp4": 0.15}[fmt]
    for shape in [(256, 384), (100, 96 if fmt == "mxfp4" else 70), (32, 64)]:
        w = torch.randn(shape, generator=gen) * 0.02
        parts = f.quantize(w.to(torch.bfloat16))
        declared = {s.name: (s.shape, s.dtype) for s in f.stored(*shape)}
        assert {k: (tuple(t.shape), t.dtype) for k, t in parts.items()} == declared
        got = f.dequantize(parts, torch.float32)
        assert torch.equal(got, R.dequantize(fmt, parts)), (fmt, shape)
        rel = ((got - w).norm() / w.norm()).item()
        assert rel < bound, (fmt, shape, rel)
        assert f.nbytes(*shape) == sum(t.numel() * t.element_size() for t in parts.values())


@pytest.mark.parametrize("dequantizer", ["native", "native-table", "torch"])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_cpu_dequantizers_match_the_plain_twin(fmt, dequantizer, monkeypatch):
    """On the CPU FP8 and INT8 weights are dequantized by kt-ft's C++ kernels (``kernels/dequant.cpp``:
    8 codes a step with AVX2, a table of the 256 outputs elsewhere, here forced by capping the
    library's path at scalar) where the library loads, else by torch: each == the plain twin,
    bitwise (NaN where the twin has NaN), one weight and several at once, bf16 and fp32, every code
    present, a shape that does not divide into FP8 blocks (nor into 8-code steps) too."""
    from kt_ft.backends import native
    from kt_ft.backends import quant as formats

    if dequantizer != "torch" and native.unavailable_reason():
        pytest.skip(f"native library unavailable: {native.unavailable_reason()}")
    if dequantizer == "native" and native.ISAS[native.best_isa()] < native.ISAS["avx2"]:
        pytest.skip("this CPU has no AVX2: the table path is the native one (native-table)")
    monkeypatch.setattr(formats, "_native_lib", lambda: None if dequantizer == "torch" else native)
    if dequantizer == "native-table":
        native.library().ktft_limit_isa(native.ISAS["scalar"])
    print(f"seed {SEED}")
    try:
        _cpu_dequantizer_case(fmt)
    finally:
        if dequantizer == "native-table":
            native.library().ktft_limit_isa(0)


def test_native_dequantizers_refuse_mismatched_tensors():
    """The native dequantizers check dtypes, shapes and layout before the C call, naming the
    format and the shapes (a wrong scale shape would read past its buffer)."""
    from kt_ft.backends import native

    if native.unavailable_reason():
        pytest.skip(f"native library unavailable: {native.unavailable_reason()}")
    q8, out = torch.zeros(2, 4, 6, dtype=torch.int8), torch.empty(2, 4, 6)
    with pytest.raises(ValueError, match=r"native int8 dequantize: .*scale \(2, 4\) .*want \(2, 4, 1\)"):
        native.dequant_int8_rows(q8, torch.ones(2, 4), out)
    with pytest.raises(
        TypeError, match="native int8 dequantize: q, scale, out dtypes torch.int8, torch.float64"
    ):
        native.dequant_int8_rows(q8, torch.ones(2, 4, 1, dtype=torch.float64), out)
    with pytest.raises(ValueError, match="native int8 dequantize: CPU tensors with contiguous rows"):
        native.dequant_int8_rows(q8, torch.ones(2, 4, 1), torch.empty(2, 6, 4).transpose(1, 2))
    qf = torch.zeros(1, 200, 300).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"native fp8 dequantize: .*want \(1, 2, 3\)"):
        native.dequant_fp8_block(qf, torch.ones(1, 2, 2), torch.empty(1, 200, 300), 128)


def _cpu_dequantizer_case(fmt: str) -> None:
    f = FORMATS[fmt]
    gen = torch.Generator().manual_seed(SEED)
    for shape in [(256, 384), (100, 70)]:
        parts = [f.quantize((torch.randn(shape, generator=gen) * 0.02).bfloat16()) for _ in range(3)]
        parts[0]["weight"].view(torch.uint8).view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(
            torch.uint8
        )
        for dtype in (torch.bfloat16, torch.float32):
            want = [R.dequantize(fmt, p).to(dtype) for p in parts]
            for got, w in zip([f.dequantize(p, dtype) for p in parts], want, strict=True):
                assert torch.equal(got.isnan(), w.isnan()) and torch.equal(got.nan_to_num(), w.nan_to_num())
            many = f.dequantize_many({k: torch.stack([p[k] for p in parts]) for k in parts[0]}, dtype)
            assert torch.equal(many.nan_to_num(), torch.stack(want).nan_to_num())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on the GPU machine")
def test_triton_fp8_dequantizer_matches_the_plain_twin():
    """On the GPU (where it runs), NaN codes included."""
    print(f"seed {SEED}")
    triton_fp8_case("cuda", on_gpu=True)


def test_triton_fp8_dequantizer_matches_the_plain_twin_in_the_interpreter():
    """The same kernel run by Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, a fresh
    process: it is read when the kernel is defined), so its indexing, masks and rounding are checked
    without a GPU (NaN codes left out, bf16 to within a step: ``helpers.quant.triton_fp8_case``)."""
    pytest.importorskip("triton")
    print(f"seed {SEED}")
    code = "from helpers.quant import triton_fp8_case; triton_fp8_case('cpu', on_gpu=False); print('ok')"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    tests_dir = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join([tests_dir, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_e4m3_bits_as_half_are_the_values_over_256(device):
    """Every one of the 256 e4m3 codes (subnormals, both zeros, the largest, NaN): the float16 of
    the bit arithmetic times 256 == torch's own conversion to float32; NaN codes give NaN."""
    from kt_ft.backends.quant import E4M3_HALF_SCALE, e4m3_as_half

    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(device)
    got = e4m3_as_half(q).float() * E4M3_HALF_SCALE
    want = q.float()
    nan = want.isnan()
    assert nan.sum().item() == 2 and got[nan].isnan().all()
    assert torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_many_is_each_weight_dequantized(fmt, device):
    """A chunk of experts at once (what GPU experts read) == ``dequantize`` of each on the CPU,
    bitwise, into a fresh tensor and into rows of a larger buffer (the gate / up parts of one fused
    weight); on CUDA too where there is one (fp8 converts there without the table)."""
    f = FORMATS[fmt]
    gen = torch.Generator().manual_seed(SEED)
    print("seed", SEED)
    for shape in [(256, 384), (96, 64)]:
        parts = [f.quantize((torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)) for _ in range(3)]
        want = torch.stack([f.dequantize(p, torch.bfloat16) for p in parts]).to(device)
        stacked = {k: torch.stack([p[k] for p in parts]).to(device) for k in parts[0]}
        assert torch.equal(f.dequantize_many(stacked, torch.bfloat16), want), (fmt, shape)
        buf = torch.zeros(3, shape[0] + 5, shape[1], dtype=torch.bfloat16, device=device)
        f.dequantize_many(stacked, torch.bfloat16, out=buf[:, 5:])
        assert torch.equal(buf[:, 5:], want) and not buf[:, :5].any(), (fmt, shape)
        one = f.dequantize({k: t[1] for k, t in stacked.items()}, torch.bfloat16)  # on the device too
        assert torch.equal(one, want[1]), (fmt, shape)


@pytest.mark.parametrize("fmt", PER_EXPERT_FORMATS)
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("transposed", [False, True], ids=["stored", "stored_transposed"])
def test_grouped_products_dequantize_a_bounded_chunk_of_experts(fmt, transpose, transposed, monkeypatch):
    """``base_mm`` on experts kept quantized: the chunks of experts it dequantizes hold at most
    ``KT_FT_DEQUANT_CHUNK_MIB`` (here two experts), experts without rows included, and the product
    equals one matmul per expert on ``w[e]`` (float32: 1e-6 of the largest entry; the same
    dequantized values, another summation order at most). With a bound that holds the layer it
    dequantizes once and reads no row counts from the device."""
    from kt_ft.backends.grouped_products import Groups, base_mm

    f = FORMATS[fmt]
    gen = torch.Generator().manual_seed(SEED)
    print("seed", SEED)
    g, rows, cols = 5, 128, 256
    parts = [f.quantize(torch.randn(rows, cols, generator=gen) * 0.02) for _ in range(g)]
    stacked = {k: torch.stack([p[k] for p in parts]) for k in parts[0]}
    w = QuantizedExperts(f, [stacked], [rows], cols, torch.float32, transposed=transposed)
    m_in = w.shape[2] if transpose else w.shape[1]
    counts = [3, 0, 7, 1, 4]
    a = torch.randn(sum(counts), m_in, generator=gen)
    want, off = [], 0
    for e, c in enumerate(counts):
        we = w[e]
        want.append(a[off : off + c] @ (we.t() if transpose else we))
        off += c
    want = torch.cat(want)
    seen = []
    orig = QuantizedExperts.experts

    def record(self, lo, hi, dtype=None):
        seen.append((lo, hi))
        return orig(self, lo, hi, dtype)

    monkeypatch.setattr(QuantizedExperts, "experts", record)
    monkeypatch.setenv("KT_FT_DEQUANT_CHUNK_MIB", str(2.5 * rows * cols * 4 / MiB))  # two experts
    groups = Groups(torch.tensor(counts), sum(counts))
    got = base_mm(a, w, groups, transpose)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max(), fmt
    assert seen == [(0, 2), (2, 4), (4, 5)], seen
    seen.clear()
    monkeypatch.setenv("KT_FT_DEQUANT_CHUNK_MIB", "256")
    groups = Groups(torch.tensor(counts), sum(counts))
    got = base_mm(a, w, groups, transpose)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max(), fmt
    assert seen == [(0, 5)] and groups._counts is None  # one chunk: no host read of the counts
    monkeypatch.setenv("KT_FT_DEQUANT_CHUNK_MIB", "zero")
    with pytest.raises(ValueError, match="KT_FT_DEQUANT_CHUNK_MIB='zero': not a positive number"):
        base_mm(a, w, groups, transpose)


def test_the_plan_counts_the_dequantized_chunk(monkeypatch):
    """A layer of experts kept quantized needs the chunk one grouped product dequantizes beside its
    activations: min(layer, max(one expert, KT_FT_DEQUANT_CHUNK_MIB)) of gate|up weights."""
    from kt_ft.plan.cost import LayerShape

    dense = LayerShape(num_experts=128, hidden=2048, inter=768, top_k=8)
    quant = LayerShape(num_experts=128, hidden=2048, inter=768, top_k=8, stored_bytes=3 * 2048 * 768)
    gate_up = 2 * 768 * 2048 * 2
    assert dense.dequant_bytes() == 0
    assert quant.gpu_act_bytes(16384) - dense.gpu_act_bytes(16384) == quant.dequant_bytes()
    assert quant.dequant_bytes() == 128 * gate_up  # the default 1024 MiB holds this layer
    monkeypatch.setenv("KT_FT_DEQUANT_CHUNK_MIB", "256")
    assert quant.dequant_bytes() == (256 * MiB // gate_up) * gate_up  # 42 experts of 256 MiB
    monkeypatch.setenv("KT_FT_DEQUANT_CHUNK_MIB", "1")
    assert quant.dequant_bytes() == gate_up  # at least one expert
    monkeypatch.setenv("KT_FT_DEQUANT_CHUNK_MIB", "100000")
    assert quant.dequant_bytes() == 128 * gate_up  # at most the layer


def test_int4_words_are_compressed_tensors_pack_quantized():
    """Hand-packed words: code j of a word in bits 4j..4j+3, stored as q + 8 (compressed-tensors'
    pack_to_int32 offset encoding): 0x76543210 holds q = -8..-1, 0xFEDCBA98 holds q = 0..7."""
    hi = 0xFEDCBA98 - 2**32  # the same bits as a signed int32
    packed = torch.tensor([[0x76543210, hi]], dtype=torch.int32)
    scale = torch.tensor([[0.5]], dtype=torch.bfloat16)
    shape = torch.tensor([1, 16], dtype=torch.int32)
    want = torch.arange(-8, 8, dtype=torch.float32)[None] * 0.5
    parts = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
    assert torch.equal(FORMATS["int4"].dequantize(parts, torch.float32), want)
    assert torch.equal(R.dequantize("int4", parts), want)
    # and kt-ft's packer writes exactly those words for those codes
    assert pack_int4(torch.arange(-8, 8)[None]).tolist() == [[0x76543210, hi]]


# --- detection: refused before any weight is read ---------------------------------------------


@pytest.mark.parametrize(
    "qc, key",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method"),
        ({"quant_method": "awq", "bits": 4}, "quant_method"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
        ({"quant_method": "fp8", "weight_block_size": [1, 128]}, "weight_block_size"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}, "format"),
    ],
)
def test_other_quantizations_are_refused_before_loading(tmp_path, qc, key):
    """gptq / awq / bnb / other schemes: refused from config.json with file, key, value and the
    supported choices -- in ``kt-ft rules check`` and in the loader, before any weight is read
    (there are none in the directory: a loader that read weights first would fail otherwise)."""
    from kt_ft.plan.builtin import resolve_rule_path
    from kt_ft.plan.loader import load_rules
    from kt_ft.runtime.loading import load_planned, planned_device_map

    model = tiny_model("qwen3_moe")
    model.config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(KTConfigError) as err:
        detect_format(json.loads((tmp_path / "config.json").read_text()), tmp_path / "config.json")
    msg = str(err.value)
    assert str(tmp_path / "config.json") in msg and key in msg and "supported: fp8" in msg, msg
    fam = FAMILIES["qwen3_moe"]
    dm, plan = planned_device_map(
        model.config, load_rules(resolve_rule_path("qwen3_moe")), fam, "torch", 1, "cpu"
    )
    with pytest.raises(KTConfigError, match=key):
        load_planned(tmp_path, dm, plan)


# --- tiny quantized checkpoints ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    """A tiny random deepseek_v3 (bf16 files) and its fp8 / int4 / int8 copies by ``kt-ft quantize``."""
    root = tmp_path_factory.mktemp("quant")
    tiny_model("deepseek_v3", seed=SEED).to(torch.bfloat16).save_pretrained(root / "bf16")
    (root / "bf16" / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    for fmt in PER_EXPERT_FORMATS:
        assert cli(["quantize", str(root / "bf16"), str(root / fmt), "--format", fmt]) == 0
    return root


def test_quantize_writes_the_layout_and_copies_the_rest(tiny_ckpts, tmp_path):
    """config.json gets the format's quantization_config, the tokenizer files are copied, no
    temporary directory is left, an existing OUT is refused, and a failure leaves no OUT."""
    for fmt in PER_EXPERT_FORMATS:
        out = tiny_ckpts / fmt
        assert detect_format(json.loads((out / "config.json").read_text())) is FORMATS[fmt]
        assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
        with safe_open(out / "model.safetensors", "pt") as f:
            keys = set(f.keys())
        marker = FORMATS[fmt].marker()
        assert f"model.layers.1.mlp.experts.7.down_proj.{marker}" in keys
        # fp8 also stores attention / shared experts quantized (DeepSeek-V3); int4/int8 experts only
        assert (f"model.layers.0.self_attn.q_a_proj.{marker}" in keys) == (fmt == "fp8")
    assert not [p for p in tiny_ckpts.iterdir() if p.name.startswith(".")]
    assert cli(["quantize", str(tiny_ckpts / "bf16"), str(tiny_ckpts / "int8"), "--format", "int8"]) == 2

    class Boom(RuntimeError):
        pass

    def fail(w):
        raise Boom

    f = FORMATS["int4"]
    orig, f.quantize = f.quantize, fail
    try:
        with pytest.raises(Boom):
            quantize_checkpoint(tiny_ckpts / "bf16", tmp_path / "out", "int4")
    finally:
        f.quantize = orig
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_dequantize_gives_the_twins_weights(tiny_ckpts, tmp_path):
    """``kt-ft dequantize``: each stored-quantized weight == the plain twin's dequantization of
    the quantized file's tensors (then rounded to bf16), every other tensor copied bitwise."""
    out = tmp_path / "d"
    assert cli(["dequantize", str(tiny_ckpts / "fp8"), str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["kt_ft_dequantized_from"]["format"] == "fp8"
    with (
        safe_open(tiny_ckpts / "fp8" / "model.safetensors", "pt") as q,
        safe_open(out / "model.safetensors", "pt") as d,
    ):
        qkeys = set(q.keys())
        n = 0
        for key in d.keys():
            stem = key[: -len("weight")]
            if f"{stem}weight_scale_inv" in qkeys:
                want = R.dequantize(
                    "fp8", {k: q.get_tensor(stem + k) for k in ("weight", "weight_scale_inv")}
                )
                assert torch.equal(d.get_tensor(key), want.to(torch.bfloat16)), key
                n += 1
            else:
                assert torch.equal(d.get_tensor(key), q.get_tensor(key)), key
    assert n == 8 * 3 * 2 + 24  # routed experts of 2 MoE layers + attention / dense / shared projections


def test_mismatched_scale_shape_names_the_tensor_and_file(tiny_ckpts, tmp_path):
    from kt_ft.formats.skeleton import meta_model
    from kt_ft.runtime.quant_loading import find_quantized_sources

    bad = tmp_path / "bad"
    bad.mkdir()
    with safe_open(tiny_ckpts / "fp8" / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"
    tensors[key] = torch.ones(2, 2)
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text((tiny_ckpts / "fp8" / "config.json").read_text())
    config = tiny_model("deepseek_v3").config
    names = ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    with pytest.raises(KTConfigError) as err:
        find_quantized_sources(bad, meta_model(config, torch.bfloat16), names, FORMATS["fp8"])
    msg = str(err.value)
    assert key in msg and str(bad / "model.safetensors") in msg and "[2, 2]" in msg and "[1, 1]" in msg, msg


def test_int4_scale_and_shape_dtypes_of_other_writers_are_read(tiny_ckpts, tmp_path):
    """compressed-tensors writes the scale in the model's dtype (fp16 here) and the shape as int64
    (kt-ft: bf16, int64; int32 shapes are read too): such files load to the same values; experts
    whose scales differ in dtype (they are stacked) are refused naming the tensor and file."""
    from kt_ft.formats.skeleton import meta_model
    from kt_ft.runtime.quant_loading import fill_quantized_experts, find_quantized_sources

    other = tmp_path / "other"
    other.mkdir()
    with safe_open(tiny_ckpts / "int4" / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k in tensors:
        if k.endswith(".weight_scale"):
            tensors[k] = tensors[k].to(torch.float16)
        elif k.endswith(".weight_shape"):
            tensors[k] = tensors[k].to(torch.int32)
    save_file(tensors, other / "model.safetensors")
    config = tiny_model("deepseek_v3").config
    names = ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    model = meta_model(config, torch.float32)
    fill_quantized_experts(
        model, find_quantized_sources(other, model, names, FORMATS["int4"]), FORMATS["int4"]
    )
    qe = model.model.layers[2].mlp.experts.down_proj
    assert qe.parts[0]["weight_scale"].dtype == torch.float16
    key = "model.layers.2.mlp.experts.5.down_proj"
    want = R.dequantize(
        "int4", {n: tensors[f"{key}.{n}"] for n in ("weight_packed", "weight_scale", "weight_shape")}
    )
    assert torch.equal(qe[5], want)
    tensors[f"{key}.weight_scale"] = tensors[f"{key}.weight_scale"].to(torch.float32)
    save_file(tensors, other / "model.safetensors")
    with pytest.raises(KTConfigError, match=rf"{key}.weight_scale is F32 .*\(as the first expert's F16\)"):
        find_quantized_sources(other, meta_model(config, torch.float32), names, FORMATS["int4"])


# --- loading and compute ----------------------------------------------------------------------


def _load(model_dir, backend, dtype=torch.float32, rule="deepseek_v3"):
    """kt-ft's loader + KTExperts (rank 4, alpha 8), every parameter trainable (router and
    embeddings get gradients through the routing weights and the experts' input)."""
    from transformers import AutoConfig

    from kt_ft.plan.builtin import resolve_rule_path
    from kt_ft.plan.loader import load_rules
    from kt_ft.runtime.loading import load_planned, planned_device_map
    from kt_ft.runtime.patch import replace_routed_experts

    config = AutoConfig.from_pretrained(model_dir)
    take_quantization_config(config)
    fam = FAMILIES["deepseek_v3"]
    dm, plan = planned_device_map(config, load_rules(resolve_rule_path(rule)), fam, backend, 1, "cpu")
    model = load_planned(model_dir, dm, plan, dtype=dtype)
    summary = replace_routed_experts(model, plan, rank=4, scaling=2.0, chunk_size=16, seed=SEED)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_b"):  # expert LoRA B starts at zero: make it count
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            if p.is_floating_point():  # (a QuantizedLinear's weight is its codes: frozen)
                p.requires_grad_(True)
    return model, summary


def _assert_grads(got: dict, want: dict, model, what="") -> None:
    """Every gradient of ``want`` (the dequantized fp32 model) in ``got`` within 1e-5 of its largest
    entry, but the weights of linear layers kept quantized (``QuantizedLinear``: frozen, no
    gradient; their input gradient is checked through everything before them)."""
    from kt_ft.runtime.quant_linear import QuantizedLinear

    kept = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert got.keys() == want.keys() - kept, (what, sorted(want.keys() ^ got.keys())[:5])
    for n, g in got.items():
        tol = 1e-5 * want[n].abs().max().item() + 1e-12
        assert (g - want[n]).abs().max().item() <= tol, (what, n)


def _loss_and_grads(model):
    ids = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(SEED + 2))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fmt", ["fp8", "int4", "int8"])
def test_training_matches_the_dequantized_model(tiny_ckpts, tmp_path, fmt):
    """Experts kept quantized (torch and reference backends) == the same checkpoint dequantized to
    fp32 by ``kt-ft dequantize`` and run by the reference backend: loss and the gradients of the
    expert LoRA, the router (routing weights) and everything before the experts (their input)."""
    print(f"seed {SEED}")
    plain = tmp_path / "fp32"
    dequantize_checkpoint(tiny_ckpts / fmt, plain, "fp32")
    ref, _ = _load(plain, "reference")
    want_loss, want = _loss_and_grads(ref)
    for backend in ("torch", "reference"):
        model, summary = _load(tiny_ckpts / fmt, backend)
        assert summary.base_format == fmt and summary.backend == backend
        experts = model.model.layers[1].mlp.experts
        assert isinstance(experts.gate_up_proj, QuantizedExperts) and experts.gate_up_proj.fmt is FORMATS[fmt]
        assert summary.expert_bytes == sum(
            m.mlp.experts.gate_up_proj.nbytes() + m.mlp.experts.down_proj.nbytes()
            for m in model.model.layers[1:]
        )
        loss, got = _loss_and_grads(model)
        assert abs(loss - want_loss) <= 1e-6 * abs(want_loss), (backend, loss, want_loss)
        for name in [n for n in want if "mlp.experts" in n or n.endswith("mlp.gate.weight") or "embed" in n]:
            assert name in got, name
        _assert_grads(got, want, model, backend)


def test_experts_are_dequantized_a_bounded_chunk_at_a_time(tiny_ckpts, monkeypatch):
    """During a forward + backward of the torch backend, every dequantization is of at most
    ``CPU_DEQUANT_CHUNK_BYTES`` of consecutive experts (here two experts' worth: each call's
    [n, rows, cols] has n <= 2 and one projection's rows and cols), experts with rows only; indexing
    a whole layer raises."""
    from kt_ft.backends import grouped

    model, _ = _load(tiny_ckpts / "int8", "torch", torch.bfloat16)
    f = FORMATS["int8"]
    monkeypatch.setattr(grouped, "CPU_DEQUANT_CHUNK_BYTES", 2 * 64 * 32 * 2)  # two [64, 32] bf16 experts
    shapes = []
    orig = f.dequantize_many

    def record(parts, dtype, out=None):
        w = orig(parts, dtype, out)
        shapes.append(tuple(w.shape))
        return w

    monkeypatch.setattr(f, "dequantize_many", record)
    _loss_and_grads(model)
    assert shapes and {s[1:] for s in shapes} <= {(32, 64), (64, 32)}, set(shapes)
    assert max(s[0] for s in shapes) == 2, set(shapes)
    qe = model.model.layers[1].mlp.experts.gate_up_proj
    with pytest.raises(TypeError, match="one expert at a time"):
        qe[0:2]


def test_unsupported_backends_are_refused(tiny_ckpts):
    from kt_ft.backends.registry import select_backend

    for name in ("kt-kernel", "torch-ep"):
        with pytest.raises(KTConfigError, match="valid choices for them: auto, native, torch, reference"):
            select_backend(name, torch.bfloat16, None, "fp8")
    # auto: native where its library runs and the experts compute in bf16, else torch, saying why
    backend, why = select_backend("auto", torch.bfloat16, None, "fp8")
    assert backend.name == ("torch" if native.unavailable_reason() else "native") and "fp8" in why
    backend, why = select_backend("auto", torch.float32, None, "fp8")
    assert backend.name == "torch" and "native: it reads bf16 expert weights" in why


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_resident_quantized_experts_match_the_dequantized_model(tiny_ckpts, tmp_path, fmt):
    """Experts 0, 3, 5 of each layer resident on the "device" (the CPU here, as tests/test_resident.py
    does: the split and the device products run as on a GPU), kept quantized there and dequantized
    a chunk of experts at a time; the rest by the CPU op. Same loss and gradients as the dequantized fp32
    model on the reference backend (tolerances of the module doc)."""
    print(f"seed {SEED}")
    plain = tmp_path / "fp32"
    dequantize_checkpoint(tiny_ckpts / fmt, plain, "fp32")
    want_loss, want = _loss_and_grads(_load(plain, "reference")[0])
    model, _ = _load(tiny_ckpts / fmt, "torch")
    for layer in model.model.layers[1:]:
        layer.mlp.experts.set_placement((0, 3, 5), (), torch.device("cpu"))
        res = layer.mlp.experts.resident
        assert isinstance(res.weights.gate_up, QuantizedExperts) and res.weights.num_experts == 3
        assert res.nbytes() == res.weights.gate_up.nbytes() + res.weights.down.nbytes()
    loss, got = _loss_and_grads(model)
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss), (loss, want_loss)
    _assert_grads(got, want, model)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_streamed_quantized_experts_match_the_dequantized_model(tiny_ckpts, tmp_path, fmt):
    """Experts 1, 2, 6 of each MoE layer streamed to the "device" (the CPU here) in their stored
    form, expert 0 resident, the rest by the CPU op; one stream buffer for every layer, so each
    layer's saved views of it are fetched back (copied again) for its backward. Same loss and
    gradients as the dequantized fp32 model on the reference backend (tolerances of the module
    doc); the bytes that crossed are the stored ones."""
    from kt_ft.runtime.streamed import StreamScheduler

    print(f"seed {SEED}")
    plain = tmp_path / "fp32"
    dequantize_checkpoint(tiny_ckpts / fmt, plain, "fp32")
    want_loss, want = _loss_and_grads(_load(plain, "reference")[0])
    model, _ = _load(tiny_ckpts / fmt, "torch")
    sched = StreamScheduler(num_slots=1)
    moe = [layer.mlp.experts for layer in model.model.layers[1:]]
    for m in moe:
        m.scheduler = sched
        m.set_placement((0,), (1, 2, 6), torch.device("cpu"))
    stored = sum(t[:3].numel() * t.element_size() for t in moe[0].streamed.base.gate_up.leaves()) + sum(
        t[:3].numel() * t.element_size() for t in moe[0].streamed.base.down.leaves()
    )
    assert stored <= moe[0].streamed.nbytes < stored + 64 * 8  # + alignment
    loss, got = _loss_and_grads(model)
    assert len(moe) >= 2 and sched.copies_by["backward"] >= 1, sched.stats()  # views fetched back
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss), (loss, want_loss)
    _assert_grads(got, want, model)


def test_the_planner_counts_quantized_experts_as_stored(tiny_ckpts):
    """placement: auto's layer shape: an expert's bytes (resident memory, stream buffers, link time)
    are its stored ones, not the compute dtype's."""
    from kt_ft.plan.auto import layer_shape
    from kt_ft.plan.placement import ExpertPlacement

    model, _ = _load(tiny_ckpts / "int4", "torch")
    e = ExpertPlacement("model.layers.1.mlp.experts", 1, "cpu", "torch", 1, None, placement="auto")
    m = model.get_submodule(e.name)
    shape = layer_shape(model, e, torch.bfloat16)
    assert shape.expert_bytes == (m.gate_up_proj.nbytes() + m.down_proj.nbytes()) // m.num_experts
    assert shape.expert_bytes < 3 * shape.hidden * shape.inter * 2 * 0.6  # int4: ~0.56 of bf16


def test_the_estimate_of_a_run_counts_loaded_quantized_experts_as_stored(tiny_ckpts, tmp_path):
    """placement: auto in a run estimates the GPU's share from the loaded model, whose quantized
    experts hold their weights in stored tensors, not parameters: the estimate's expert bytes are
    those tensors', i.e. the dequantized model's minus what dequantizing added."""
    from transformers import AutoConfig

    from kt_ft.plan.builtin import resolve_rule_path
    from kt_ft.plan.loader import load_rules
    from kt_ft.plan.report import TrainSizes, estimate
    from kt_ft.runtime.loading import planned_device_map

    plain = tmp_path / "fp32"
    dequantize_checkpoint(tiny_ckpts / "int8", plain, "fp32")
    rules = load_rules(resolve_rule_path("deepseek_v3"))
    cpu_params, models = {}, {}
    for name, path in (("int8", tiny_ckpts / "int8"), ("fp32", plain)):
        model = models[name] = _load(path, "torch")[0]
        config = AutoConfig.from_pretrained(path)
        take_quantization_config(config)
        _, plan = planned_device_map(config, rules, FAMILIES["deepseek_v3"], "torch", 1, "cpu")
        report = estimate(model, plan, torch.float32, TrainSizes(16, 1, 4))
        cpu_params[name] = report["devices"]["cpu"]["param_bytes"]
    model = models["int8"]
    layers = [m.mlp.experts for m in model.model.layers[1:]]
    stored = sum(m.gate_up_proj.nbytes() + m.down_proj.nbytes() for m in layers)
    dense = sum(
        3 * m.num_experts * model.config.hidden_size * model.config.moe_intermediate_size * 4 for m in layers
    )
    assert abs((cpu_params["fp32"] - cpu_params["int8"]) - (dense - stored)) <= 16, (
        cpu_params,
        dense,
        stored,
    )


# --- linear layers kept quantized (DeepSeek-V3's FP8 attention and MLPs) -------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_is_the_dequantized_linear(fmt, dtype, monkeypatch):
    """Forward and input gradient equal (bitwise: the same dequantized W, the same product) those of
    an nn.Linear holding W dequantized; nothing of W's size [out, in] is saved for the backward.
    (KT_FT_CPU_UPCAST=0: torch's own product in the model's dtype on any CPU; the fp32 products of a
    CPU without bf16 are the next test's.)"""
    from kt_ft.runtime.quant_linear import QuantizedLinear

    monkeypatch.setenv("KT_FT_CPU_UPCAST", "0")
    gen = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    # not multiples of the FP8 block (128) nor of the INT4 group times 8; mxfp4: whole groups of 32
    out, inp = 48, 96 if fmt == "mxfp4" else 80
    f = FORMATS[fmt]
    stored = f.quantize(torch.randn(out, inp, generator=gen) * 0.1)
    bias = torch.randn(out, generator=gen).to(dtype)
    q = QuantizedLinear(f, stored, out_features=out, in_features=inp, bias=bias, dtype=dtype)
    ref = torch.nn.Linear(inp, out, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(f.dequantize(stored, dtype))
        ref.bias.copy_(bias)
    x = torch.randn(3, 5, inp, generator=gen).to(dtype).requires_grad_(True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        y = q(x)
    g = torch.randn(y.shape, generator=gen).to(dtype)
    (dx,) = torch.autograd.grad(y, x, g)
    x2 = x.detach().requires_grad_(True)
    y2 = ref(x2)
    (dx2,) = torch.autograd.grad(y2, x2, g)
    assert torch.equal(y, y2) and torch.equal(dx, dx2)
    assert all(n < out * inp for n in sizes), sizes
    assert q.weight.dtype == torch.uint8 and not q.weight.requires_grad
    assert q.stored_nbytes() == f.nbytes(out, inp)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_linear_on_a_cpu_without_bf16_computes_in_fp32(fmt, monkeypatch):
    """KT_FT_CPU_UPCAST on a CPU without bf16 arithmetic (forced here): a bf16 QuantizedLinear's W is
    dequantized to fp32 and the product runs in fp32: output and input gradient are the fp32
    product of the same values rounded once to bf16 (bitwise), and within bf16 rounding of torch's
    bf16 product."""
    from kt_ft.backends import cpu_fp32
    from kt_ft.runtime.quant_linear import QuantizedLinear

    monkeypatch.setattr(cpu_fp32, "_cpu_lacks_bf16", lambda: True)
    gen = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    out, inp = 48, 80
    f = FORMATS[fmt]
    stored = f.quantize(torch.randn(out, inp, generator=gen) * 0.1)
    q = QuantizedLinear(f, stored, out_features=out, in_features=inp, bias=None, dtype=torch.bfloat16)
    x = torch.randn(7, inp, generator=gen).bfloat16().requires_grad_(True)
    y = q(x)
    g = torch.randn(y.shape, generator=gen).bfloat16()
    (dx,) = torch.autograd.grad(y, x, g)
    w32 = f.dequantize(stored, torch.float32)
    assert y.dtype == torch.bfloat16 and torch.equal(y, (x.detach().float() @ w32.t()).bfloat16())
    assert torch.equal(dx, (g.float() @ w32).bfloat16())
    monkeypatch.setenv("KT_FT_CPU_UPCAST", "0")
    y_bf16 = q(x)
    assert (y_bf16.float() - y.float()).abs().max() <= 2**-7 * y.float().abs().max()


def test_peft_wraps_a_quantized_linear_with_a_float_lora():
    """LoRA on a QuantizedLinear (PEFT's own Linear wrapper): the LoRA keeps its float dtype (the
    codes are uint8, which PEFT does not cast to), trains, and the base stays frozen."""
    from peft import LoraConfig, get_peft_model

    from kt_ft.runtime.quant_linear import QuantizedLinear

    gen = torch.Generator().manual_seed(SEED)
    f = FORMATS["fp8"]
    q = QuantizedLinear(f, f.quantize(torch.randn(32, 64, generator=gen)), out_features=32, in_features=64,
                        bias=None, dtype=torch.float32)  # fmt: skip
    model = get_peft_model(torch.nn.Sequential(q), LoraConfig(r=4, lora_alpha=8, target_modules=["0"]))
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora.values())
    with torch.no_grad():
        for p in lora.values():
            p.normal_(0, 0.1, generator=gen)
    model(torch.randn(2, 64, generator=gen)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())
    assert q.weight.grad is None


def _dequantize_kept_linears(model) -> None:
    """Every ``QuantizedLinear`` of ``model`` replaced by a plain ``nn.Linear`` holding its weight
    dequantized in its compute dtype (what a load that dequantizes writes), trainable as ``_load``
    leaves the weights."""
    from kt_ft.runtime.quant_linear import QuantizedLinear

    for name, q in list(model.named_modules()):
        if not isinstance(q, QuantizedLinear):
            continue
        lin = torch.nn.Linear(q.in_features, q.out_features, bias=False, dtype=q.compute_dtype)
        with torch.no_grad():
            lin.weight.copy_(q.dequantized())
        lin.bias = q.bias
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, lin)


def test_fp8_linear_layers_are_kept_quantized_at_load(tiny_ckpts):
    """The fp8 checkpoint's attention and MLP projections load as QuantizedLinear (stored bytes);
    the same load with each of them replaced by an nn.Linear holding its dequantization gives the
    same loss and gradients (the same W each call)."""
    from kt_ft.runtime.quant_linear import QuantizedLinear

    model, _ = _load(tiny_ckpts / "fp8", "torch")
    kept = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert any("self_attn" in n for n in kept) and any("shared_experts" in n for n in kept)
    assert not any(n.endswith(("lm_head", "mlp.gate")) for n in kept)
    loss, got = _loss_and_grads(model)
    plain, _ = _load(tiny_ckpts / "fp8", "torch")
    _dequantize_kept_linears(plain)
    assert not any(isinstance(m, QuantizedLinear) for m in plain.modules())
    want_loss, want = _loss_and_grads(plain)
    assert loss == want_loss
    _assert_grads(got, want, model)


# --- memory: the experts stay quantized -------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
def test_loading_fp8_peaks_below_the_bf16_experts(tmp_path):
    """Loading a DeepSeek-V3-layout fp8 checkpoint (64 experts of H 512, I 384, 2 MoE layers: 151
    MiB of experts in bf16, 76 MiB stored) in a fresh process: peak RSS growth stays below the
    experts' bf16 size, and within 1.1 x their stored bytes + the rest + 48 MiB."""
    assert_quantized_load_peak(
        tmp_path, "fp8", "deepseek_v3", hidden_size=512, moe_intermediate_size=384, n_routed_experts=64
    )


# --- plans ------------------------------------------------------------------------------------

DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=4096,
    torch_dtype="bfloat16",
    quantization_config={
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
)


def _plan(tmp_path, config, capsys, *extra: str) -> dict:
    d = tmp_path / config.get("quantization_config", {}).get("quant_method", "bf16")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    cli(["rules", "plan", "--rule", "deepseek_v3", "--model", str(d), "--cpu-infer", "16", "--json", *extra])
    return json.loads(capsys.readouterr().out)


def test_rules_plan_counts_fp8_experts_as_stored(tmp_path, capsys):
    """DeepSeek-V3's real config, fp8 as distributed: the CPU holds the experts' stored bytes
    (1 byte a weight + a float32 per 128x128 block), from config.json alone: about half of the
    same config in bf16, and under 800 GB of host memory in all."""
    fp8 = _plan(tmp_path, DEEPSEEK_V3, capsys)
    bf16 = _plan(tmp_path, {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}, capsys)
    assert fp8["expert_format"] == "fp8" and bf16["expert_format"] is None
    layers, e, h, i = 61 - 3, 256, 7168, 2048
    stored = layers * e * 3 * (h * i + (h // 128) * (i // 128) * 4)  # by hand: weights + block scales
    bf16_experts = layers * e * 3 * h * i * 2
    cpu8, cpu16 = fp8["devices"]["cpu"]["param_bytes"], bf16["devices"]["cpu"]["param_bytes"]
    assert cpu16 - cpu8 == bf16_experts - stored  # the non-expert part is the same (bf16) in both
    print(
        f"DeepSeek-V3 CPU: fp8 {fp8['devices']['cpu']['total_bytes'] / 1e9:.0f} GB, bf16 {bf16['devices']['cpu']['total_bytes'] / 1e9:.0f} GB"
    )
    assert fp8["devices"]["cpu"]["total_bytes"] <= 800e9 < bf16["devices"]["cpu"]["total_bytes"]


def test_rules_plan_counts_fp8_linear_layers_as_stored(tmp_path, capsys):
    """DeepSeek-V3 fp8 as distributed, from config.json and the files' headers (a header-only
    model.safetensors: every linear weight outside the routed experts stored fp8 with its block
    scales, as the real files are): those layers are kept quantized on the GPU (1 byte a weight +
    the scales): the training GPU's total drops by their bf16 bytes less the stored ones, and with
    the chunked loss (models/lm_loss.py) fits 24 GiB at cutoff_len 2048 (36.3 GiB dequantized, 22.2
    kept)."""
    import struct

    from transformers import AutoConfig

    from kt_ft.formats.skeleton import meta_model

    d = tmp_path / "fp8h"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    model = meta_model(AutoConfig.from_pretrained(d), torch.bfloat16)
    header, off, stored, dense = {}, 0, 0, 0
    for name, m in model.named_modules():
        if (
            type(m) is not torch.nn.Linear
            or ".mlp.experts." in name
            or name.endswith(("lm_head", "mlp.gate"))
        ):
            continue
        out, inp = m.out_features, m.in_features
        for key, dt, shape, size in (
            ("weight", "F8_E4M3", [out, inp], 1),
            ("weight_scale_inv", "F32", [-(-out // 128), -(-inp // 128)], 4),
        ):
            n = shape[0] * shape[1] * size
            header[f"{name}.{key}"] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
            off += n
        stored += FORMATS["fp8"].nbytes(out, inp)
        dense += 2 * out * inp  # bf16
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)  # headers, no data
    capsys.readouterr()
    cli(["rules", "plan", "--rule", "deepseek_v3", "--model", str(d), "--cpu-infer", "16", "--json"])
    kept = json.loads(capsys.readouterr().out)["devices"]["cuda:0"]
    plain = _plan(tmp_path, DEEPSEEK_V3, capsys)["devices"]["cuda:0"]  # config alone: dequantized
    assert plain["param_bytes"] - kept["param_bytes"] == dense - stored
    print({k: f"{v / 2**30:.2f} GiB" for k, v in kept.items() if k.endswith("bytes")})
    print(
        f"DeepSeek-V3 fp8 GPU: kept {kept['total_bytes'] / 2**30:.1f} GiB, dequantized {plain['total_bytes'] / 2**30:.1f} GiB"
    )
    assert kept["total_bytes"] <= 24 * 2**30 < plain["total_bytes"]


def test_rules_plan_counts_int4_experts_as_stored(tmp_path, capsys):
    """Kimi K2's shapes (as a deepseek_v3 config: 61 layers, 384 experts of H 7168, I 2048) with
    its routed experts INT4 (compressed-tensors pack-quantized, group 32): each weight 0.5 byte
    packed + a bf16 scale per 32 + its int64 shape pair: 571 GB of weights in RAM. The CPU's total
    adds the rank-8 expert LoRA's training state (5.1 B parameters: 82 GB with fp32 AdamW, 41 GB
    under LLaMA-Factory's pure_bf16) and what the CPU op keeps for the backward (27 GB): under
    640 GB with pure_bf16."""
    k2 = {**DEEPSEEK_V3, "n_routed_experts": 384, "first_k_dense_replace": 1, "num_attention_heads": 64}
    k2["vocab_size"], k2["n_group"], k2["topk_group"] = 163840, 1, 1
    k2["quantization_config"] = FORMATS["int4"].quantization_config()
    int4 = _plan(tmp_path, k2, capsys)
    assert int4["expert_format"] == "int4"
    layers, e, h, i = 61 - 1, 384, 7168, 2048
    per_weight = h * i // 2 + h * i // 32 * 2 + 16  # packed + scales + shape, each of 3 per expert
    experts = layers * e * 3 * per_weight
    non_expert_cpu = int4["devices"]["cpu"]["param_bytes"] - experts
    assert 0 <= non_expert_cpu < 1e6, non_expert_cpu  # everything else on the GPU
    cpu = int4["devices"]["cpu"]
    pure = _plan(tmp_path, k2, capsys, "--pure-bf16")["devices"]["cpu"]
    print(
        f"Kimi-K2-shaped int4 CPU: weights {cpu['param_bytes'] / 1e9:.0f} GB, total {cpu['total_bytes'] / 1e9:.0f} GB, "
        f"with pure_bf16 {pure['total_bytes'] / 1e9:.1f} GB"
    )
    assert cpu["param_bytes"] <= 640e9
    assert pure["train_state_bytes"] * 2 == cpu["train_state_bytes"] == cpu["lora_params"] * 16
    assert pure["total_bytes"] <= 640e9 < cpu["total_bytes"]


# --- checkpoints: manifest and merge -----------------------------------------------------------


def test_manifest_records_the_base_format_and_merge_refuses_it(demo_assets, tmp_path, capsys):
    """Through LLaMA-Factory: an int8 copy of the demo (``assert_quantized_adapter_round_trip``)."""
    pytest.importorskip("llamafactory")
    assert_quantized_adapter_round_trip(demo_assets, "int8", tmp_path, capsys)


def test_take_quantization_config_strips_only_what_it_reads():
    cfg = copy.deepcopy(tiny_model("deepseek_v3").config)
    cfg.quantization_config = FORMATS["fp8"].quantization_config()
    assert take_quantization_config(cfg) is FORMATS["fp8"]
    assert getattr(cfg, "quantization_config", None) is None
    cfg.quantization_config = {"quant_method": "gptq"}
    with pytest.raises(KTConfigError):
        take_quantization_config(cfg)
    assert cfg.quantization_config == {"quant_method": "gptq"}  # untouched when refused


def test_experts_interface_dispatch_reads_quantized_experts(tiny_ckpts, tmp_path):
    """``experts_implementation='kt_ft'`` (what ``kt-ft models`` checks a type with) on experts kept
    fp8: logits equal transformers' eager run of the checkpoint dequantized to fp32 (fp32, 1e-5 of
    the largest logit: another summation order)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kt_ft.plan.builtin import resolve_rule_path
    from kt_ft.plan.loader import load_rules
    from kt_ft.runtime.dispatch import use_kt_ft_experts
    from kt_ft.runtime.loading import load_planned, planned_device_map

    dequantize_checkpoint(tiny_ckpts / "fp8", tmp_path / "d", "fp32")
    config = AutoConfig.from_pretrained(tiny_ckpts / "fp8")
    take_quantization_config(config)
    dm, plan = planned_device_map(
        config, load_rules(resolve_rule_path("deepseek_v3")), FAMILIES["deepseek_v3"], "torch", 1, "cpu"
    )
    model = load_planned(tiny_ckpts / "fp8", dm, plan, dtype=torch.float32)
    use_kt_ft_experts(model)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "d", dtype=torch.float32)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
